"""Checkpoints of a training run: ``checkpoint-<step>/`` written atomically, sized before training, pruned,
and read back (weights, optimizer, scheduler, data position and RNG state) so that a resumed run repeats
the uninterrupted one's losses.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distill.drafters.build import merge_drafter, state_dict_bytes
from distill.errors import DiskFullError, DraftsmithError
from distill.files import human_bytes, make_shareable, require_free_space
from distill.parallel import is_fsdp2

log = logging.getLogger(__name__)


STATE_FILE = "trainer_state.json"


STATE_FORMAT = 1


def save_checkpoint(run: Any, output_dir: Path, *, step: int, examples_seen: int, tokens_seen: int,
                     validation_before: dict | None = None) -> Path:
    """Write ``checkpoint-<step>/`` atomically (temp folder, then rename) and return its path.

    ``validation_before`` (the untrained drafter's validation figures) rides in the state file so
    that a resumed run reports them rather than re-measuring the half-trained drafter.

    Under FSDP every process takes part in gathering the shards: the trained weights into ``run.plain`` (an
    ordinary model, saved as any other) and the full AdamW state, keyed by parameter name (torch's
    ``get_optimizer_state_dict``); the main process writes them.
    """
    accelerator = run.accelerator
    final = output_dir / f"checkpoint-{step}"
    accelerator.wait_for_everyone()
    optimizer_state = _optimizer_state_to_save(run)
    rng_states = _rng_states_of_every_process(accelerator)
    if accelerator.is_main_process:
        tmp = output_dir / f".checkpoint-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            run.plain.save_pretrained(tmp)
            torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(run.scheduler.state_dict(), tmp / "scheduler.pt")
        except (OSError, RuntimeError) as err:  # torch.save reports ENOSPC as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(output_dir).free
            if not _looks_disk_full(err, free, checkpoint_bytes(run.plain)):
                raise
            raise DiskFullError(f"the disk filled up writing checkpoint {final} ({human_bytes(free)} free); "
                                f"earlier checkpoints in {output_dir} are intact: free space and run the same "
                                f"command again to resume") from err
        state = {"format": STATE_FORMAT, "step": step, "examples_seen": examples_seen,
                 "tokens_seen": tokens_seen, "data": run.data_key, "rng": rng_states[0],
                 "parallel": "fsdp" if is_fsdp2(accelerator) else "ddp"}
        if len(rng_states) > 1:  # each process draws its own dropout masks: resume restores each one's
            state["rng_per_process"] = rng_states
        if validation_before:
            state["validation_before"] = validation_before
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
        make_shareable(tmp)  # safetensors writes 0600
        if final.exists():
            old = output_dir / f".checkpoint-{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _optimizer_state_to_save(run: Any) -> dict:
    """The optimizer state a checkpoint holds, on the main process (``{}`` on the others); under FSDP also
    gathers the trained weights into ``run.plain``."""
    if not is_fsdp2(run.accelerator):
        return run.optimizer.state_dict() if run.accelerator.is_main_process else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    copy_sharded_weights(run.drafter, run.plain)
    # full, on the main process's CPU only: no process holds the whole state on its GPU
    return get_optimizer_state_dict(run.drafter, _bare_optimizer(run.optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(accelerator: Any, drafter: torch.nn.Module, optimizer: Any, path: Path) -> None:
    """Load ``path/optimizer.pt`` into the prepared ``optimizer`` of the prepared ``drafter``.

    Under FSDP the file holds the full state keyed by parameter name, and each process keeps its shard (torch's
    ``set_optimizer_state_dict``); otherwise it is ``optimizer.state_dict()`` as saved. Every process reads the
    file (one machine, or a folder all machines share), mapped to the CPU so that none allocates on the main
    process's device.
    """
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if not is_fsdp2(accelerator):
        optimizer.load_state_dict(saved)  # moves the state to each parameter's device
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(drafter, _bare_optimizer(optimizer), saved, options=StateDictOptions(full_state_dict=True))


def copy_sharded_weights(sharded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Copy the trainable parameters of an FSDP2-sharded model into ``plain``, the same model unsharded.

    A collective: every process calls it, in the same order of parameters (each one is gathered whole in turn, so
    no process holds more than one full parameter beyond ``plain``). Frozen parameters are not copied: training
    does not change them.
    """
    from torch.distributed.tensor import DTensor

    own = dict(plain.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            if param.requires_grad:
                full = param.full_tensor() if isinstance(param, DTensor) else param
                own[name].copy_(full.to(own[name].device, own[name].dtype))


def check_resume_parallel(state: dict, path: Path, parallel: str) -> None:
    """Refuse to resume a checkpoint under the other ``distill.parallel``: FSDP's optimizer state is keyed by
    parameter name, DDP's by position.

    Raises:
        DraftsmithError: the checkpoint was written under the other mode.
    """
    saved = state.get("parallel", "ddp")
    if saved != parallel:
        raise DraftsmithError(f"{path} was written with distill.parallel={saved} (its optimizer state is stored "
                              f"that way): resume with distill.parallel={saved}, or start fresh")


def _bare_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper (torch's state-dict helpers may step an empty optimizer to
    create its state, which must not step accelerate's gradient scaler)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def checkpoint_bytes(drafter: torch.nn.Module) -> int:
    """Estimated size of one ``checkpoint-<step>/`` folder of ``drafter``, in bytes.

    The saved weights (the whole state dict, tied tensors once; a peft model saves only its trainable
    adapter) plus the AdamW state (two tensors per trainable parameter, ``exp_avg`` and ``exp_avg_sq``)
    plus the small files. Within a few percent of the files written (a 20-layer pruned 0.5B, full
    fine-tune: 3.95 GiB estimated and written).
    """
    trained = [p for p in drafter.parameters() if p.requires_grad]
    trainable = sum(p.numel() * p.element_size() for p in trained)
    if hasattr(drafter, "peft_config"):
        weights = trainable
    else:
        weights = state_dict_bytes(drafter)
    # ~1 KiB per saved optimizer entry and 16 KiB of config, README and state files: only tiny models notice
    return weights + 2 * trainable + 1024 * len(trained) + 16 * 1024


def checkpoint_due(step: int, *, max_steps: int, checkpoint_every: int, checkpoint_at=()) -> bool:
    """Whether optimizer step ``step`` writes a checkpoint: every ``checkpoint_every`` steps (0 = none), at each
    step of ``checkpoint_at`` (budget points) and at the last."""
    return bool(checkpoint_every and step % checkpoint_every == 0) or step in checkpoint_at or step == max_steps


def check_checkpoint_space(drafter: torch.nn.Module, output_dir: Path, *, start_step: int, max_steps: int,
                            checkpoint_every: int, keep: int, warn: bool = True, checkpoint_at=()) -> None:
    """Refuse before training if the disk cannot hold one checkpoint; warn if it cannot hold the peak.

    A new checkpoint is written before older ones are pruned, so ``keep`` kept checkpoints need room
    for ``keep + 1`` at once (``keep = 0``: all of them).

    Raises:
        DiskFullError: less free space at ``output_dir`` than one checkpoint takes.
    """
    due = [step for step in range(start_step + 1, max_steps + 1)  # as the training loop decides
           if checkpoint_due(step, max_steps=max_steps, checkpoint_every=checkpoint_every, checkpoint_at=checkpoint_at)]
    to_write = len(due)
    if not to_write:
        return
    size, free = checkpoint_bytes(drafter), shutil.disk_usage(output_dir).free
    kept_anyway = sum(1 for step in due if step in checkpoint_at and step != max_steps)  # never pruned
    peak = to_write if not keep else min(to_write, keep + 1 + kept_anyway)
    require_free_space(output_dir, size, "a training checkpoint (weights + optimizer state)")
    if warn and free < peak * size:
        log.warning("%.2f GiB free at %s holds %d of the %d checkpoints of about %.2f GiB each that this run keeps "
                    "at once (distill.keep_checkpoints=%d keeps up to %d while the next is written): the run will "
                    "stop when the disk fills; lower distill.keep_checkpoints or raise distill.checkpoint_every",
                    free / 2**30, output_dir, int(free // size), peak, size / 2**30, keep, peak)


def _looks_disk_full(err: BaseException, free: int, needed: int) -> bool:
    """Whether a failed checkpoint write was the disk filling up (torch.save words it several ways)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    # PyTorch's zip writer reports a short write as "unexpected pos <a> vs <b>" rather than ENOSPC
    return "No space left" in text or "unexpected pos" in text or free < needed


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-<step>`` folder in ``folder`` that holds its state file, by step."""
    found = []
    for path in Path(folder).glob("checkpoint-*"):
        step = path.name.split("-", 1)[1]
        if step.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return sorted(found)


def budget_checkpoints(folder: Path, final_step: int | None) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``folder`` before ``final_step`` (the run's last step,
    whose drafter is the final one; None: all), by step: the budget points ``evaluate.checkpoints`` measures."""
    return [(step, path) for step, path in complete_checkpoints(folder) if final_step is None or step < final_step]


def prune_checkpoints(output_dir: Path, keep: int, protected=()) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (by step), sparing the steps in ``protected``
    (``distill.checkpoint_at``'s budget points)."""
    prunable = [(step, path) for step, path in complete_checkpoints(output_dir) if step not in protected]
    for _, path in prunable[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_state(path: Path, data_key: dict) -> dict:
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise DraftsmithError(f"{path} is not a complete checkpoint (no {STATE_FILE}): resume from another "
                              "checkpoint-<step> folder or start fresh")
    state = json.loads(state_path.read_text(encoding="utf-8"))
    if state.get("format") != STATE_FORMAT:
        raise DraftsmithError(f"{state_path} has format {state.get('format')}, expected {STATE_FORMAT}: start fresh")
    saved = {"num_processes": 1, **state["data"]}  # checkpoints from before multi-process training
    changed = {k: (saved.get(k), v) for k, v in data_key.items() if saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: checkpoint {old} vs now {new}" for k, (old, new) in changed.items())
        raise DraftsmithError(f"cannot resume from {path}: the data order would change ({detail}); "
                              "resume with the same examples (inputs.generate, inputs.extra_generate, "
                              "distill.val_fraction) and settings, or start fresh")
    return state


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a ``save_pretrained`` folder (full model or peft adapter) into ``model`` in place."""
    from peft import PeftModel, load_peft_weights, set_peft_model_state_dict
    from safetensors.torch import load_file

    if isinstance(model, PeftModel):
        if not (path / "adapter_config.json").is_file():
            raise DraftsmithError(f"{path} holds no LoRA adapter but the drafter is a LoRA model: "
                                  "build the drafter as in the run that wrote the checkpoint")
        result = set_peft_model_state_dict(model, load_peft_weights(str(path), device="cpu"))
        if result.unexpected_keys:
            raise DraftsmithError(f"adapter in {path} does not fit the drafter (unexpected "
                                  f"{result.unexpected_keys[:3]}): build the drafter with the same LoRA settings")
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DraftsmithError(f"{path} holds no full model weights (model.safetensors) but the drafter is "
                              "trained in full: build the drafter as in the run that wrote the checkpoint")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    own = model.state_dict(keep_vars=True)
    loaded_ids = {id(own[k]) for k in weights if k in own}
    missing = [k for k in missing if id(own[k]) not in loaded_ids]  # tied weights are saved once
    if missing or unexpected:
        raise DraftsmithError(f"weights in {path} do not fit the drafter (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}): build the drafter as in the run that wrote the checkpoint")


def trained_drafter_at(base: torch.nn.Module, checkpoint: Path) -> torch.nn.Module:
    """The drafter ``checkpoint`` (a ``checkpoint-<step>`` folder) holds, merged: ``base`` is the undistilled
    drafter built as the run built it (its reduced head, if any, applied) and without LoRA; a LoRA checkpoint's
    adapter is attached (peft reads its settings from ``adapter_config.json``) and merged, a full one's weights
    are loaded into ``base`` in place.

    Raises:
        DraftsmithError: the checkpoint's weights do not fit ``base``.
    """
    checkpoint = Path(checkpoint)
    if (checkpoint / "adapter_config.json").is_file():
        from peft import PeftModel

        try:
            return merge_drafter(PeftModel.from_pretrained(base, str(checkpoint)))
        except (RuntimeError, ValueError, KeyError) as err:  # peft's words for an adapter of another shape
            raise DraftsmithError(f"the LoRA adapter in {checkpoint} does not fit the drafter ({err}): evaluate it "
                                  "with the drafter.* settings of the run that wrote it") from err
    load_weights(base, checkpoint)
    return base


def checkpoint_tokens(checkpoint: Path) -> dict[str, int]:
    """``{"step", "tokens_seen", "examples_seen"}`` from ``checkpoint``'s state file (tokens: completion
    tokens trained on, as ``metrics.jsonl`` counts them)."""
    state = json.loads((Path(checkpoint) / STATE_FILE).read_text(encoding="utf-8"))
    return {k: int(state[k]) for k in ("step", "tokens_seen", "examples_seen")}


def _rng_states_of_every_process(accelerator: Any) -> list[dict]:
    """:func:`get_rng_state` of every process in rank order (a collective: every process calls it)."""
    if accelerator.num_processes == 1:
        return [get_rng_state()]
    from accelerate.utils import gather_object

    return gather_object([get_rng_state()])


def rng_state_to_resume(state: dict, process_index: int, num_processes: int) -> dict:
    """The RNG state this process resumes with from a checkpoint's ``state``: its own when the checkpoint
    was written by as many processes (``rng_per_process``), else the main process's (``rng``; the run then
    draws other dropout masks than an uninterrupted one would)."""
    per_process = state.get("rng_per_process") or []
    return per_process[process_index] if len(per_process) == num_processes else state["rng"]


def get_rng_state() -> dict:
    def encode(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode("ascii")

    state = {"torch": encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    def decode(s: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())

    torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(s) for s in state["cuda"]])
