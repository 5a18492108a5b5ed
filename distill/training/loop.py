"""Stage 2 core: the drafter learns the target's next-token distributions.

White-box distillation on the target's own answers (DistillSpec, Zhou et al. 2023: "on-policy"
data from the target, a divergence between the two next-token distributions at every
completion position). The target is scored online, under ``torch.no_grad()``, on the same
token sequences the drafter sees.

Layout, torchtune-style (``recipes/knowledge_distillation_single_device.py``): setup
(:func:`_setup`) -> loss step (:func:`_loss_step`) -> train loop (:func:`train_drafter`) ->
save (:func:`save_checkpoint`). Figures go through one :class:`_Sink`, outside the loop body.

Files written under ``output_dir``:

* ``metrics.jsonl``: one JSON object per optimizer step: ``step``, ``loss`` (nats per
  completion token), ``lr``, ``tokens`` (completion tokens in the step), ``tokens_per_s``,
  ``expected_acceptance`` (token-weighted mean of ``1 - TV(p, q)`` on the step's batches, at the
  training temperature), ``grad_norm`` (before clipping).
* ``checkpoint-<step>/``: the drafter (``save_pretrained``: the full model, or the LoRA adapter
  for a peft model), ``optimizer.pt``, ``scheduler.pt`` and ``trainer_state.json``; written to a
  temporary folder and renamed, so a checkpoint folder is either complete or absent.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from tqdm.auto import tqdm

from decode.acceptance import TeacherForced, simulate_greedy
from decode.metrics import DecodeStats
from decode.progress import heartbeat
from decode.teacher_forcing import drafter_predictions
from distill.config import DistillConfig
from distill.errors import DraftsmithError, OutOfMemoryError, out_of_memory_bytes
from distill.files import write_text_atomic
from distill.hardware import resolve_mixed_precision
from distill.models.reduced_vocab import draft_vocabulary_logits, draft_vocabulary_of, restrict_logits
from distill.parallel import accelerator_kwargs, fsdp_refusal, is_fsdp2, restores_fsdp_flag
from distill.training.checkpoint import (
    check_checkpoint_space,
    check_resume_parallel,
    copy_sharded_weights,
    load_optimizer_state,
    load_weights,
    checkpoint_due,
    prune_checkpoints,
    read_state,
    rng_state_to_resume,
    save_checkpoint,
    set_rng_state,
)
from distill.training.losses import LOSS_KINDS, distillation_loss, expected_acceptance, top_k_distillation_loss
from distill.training.packing import check_packing, pack_batch

log = logging.getLogger(__name__)

MAX_GRAD_NORM = 1.0
METRICS_FILE = "metrics.jsonl"
VALIDATION_FILE = "validation.jsonl"  # the held-out figures at step 0, every validate_every steps and at the end
_VAL_FIGURES = ("loss", "expected_acceptance", "top1_agreement", "simulated_tau", "simulated_acceptance")


@dataclass(frozen=True)
class LossSpec:
    """Which divergence to minimise (see :func:`distill.training.losses.distillation_loss`)."""

    kind: str = "fkl"
    jsd_beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss must be one of {LOSS_KINDS}, got {self.kind!r}")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@restores_fsdp_flag
def train_drafter(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    examples: Sequence[dict],
    settings: DistillConfig,
    *,
    output_dir: Path,
    resume_from: Path | None = None,
    val_examples: Sequence[dict] | None = None,
    pad_token_id: int | None = None,
    logger: Any = None,
    progress: bool = True,
    eos_token_ids: Sequence[int] = (),
    validation_draft_length: int = 0,
) -> dict[str, Any]:
    """Distil ``target`` into ``drafter`` on the target's answers; the drafter is trained in place.

    Each optimizer step consumes ``batch_size * grad_accum`` examples. The loss is the
    token-weighted mean over all completion positions of the step (gradient accumulation keeps
    the token weighting). AdamW over the trainable parameters only (no weight decay on biases
    and norms), linear warmup over ``warmup_steps`` then linear decay to 0 at ``max_steps``,
    gradient norm clipped to 1.0. Runs under ``accelerate.Accelerator`` (CPU or one GPU; the
    target is moved to the accelerator's device unless it has an ``hf_device_map``).

    Several processes (``torchrun --nproc_per_node N`` or ``accelerate launch --multi_gpu
    --num_processes N``; DDP; on CPU over gloo, with ``ACCELERATE_USE_CPU=1``):
    every process calls this with the same models, examples and arguments; process r takes batches
    r, r + N, ... of the example stream, so a step consumes ``N * batch_size * grad_accum`` examples.
    DDP averages the gradients over processes, and each process weights its loss by
    ``N * its tokens / all processes' tokens`` (an all-reduce of the token counts), so the step is
    the token-weighted mean over all processes' completion tokens, exactly as one process with
    ``N * batch_size`` would take it. The weights stay identical on every process. Metrics and
    results (loss, tokens, ``tokens_seen``) are those of all processes together; only the main
    process writes ``metrics.jsonl``, logs to ``logger``, shows the bar and writes checkpoints.
    A checkpoint resumes only with the same number of processes.

    ``settings.parallel="fsdp"`` (CUDA under a launcher; refused elsewhere, see
    :func:`distill.parallel.fsdp_refusal`): accelerate's FSDP2 shards a copy of the drafter over the processes
    (:func:`distill.parallel.accelerator_kwargs`); the same batches, token weighting and steps as DDP. The
    caller's ``drafter`` stays an ordinary model: each checkpoint gathers the trained weights into it and saves
    it, and at the end it holds the trained weights on every process. The target is not sharded.

    Data order: epoch e visits the examples in ``numpy.random.default_rng([seed, e])
    .permutation(n)``; batches run across epoch boundaries until ``max_steps``. A resumed run
    continues the same stream at the saved position, with the saved optimizer, scheduler and
    torch RNG state (LoRA dropout), so its losses match an uninterrupted run.

    Args:
        drafter: causal LM (plain or peft-wrapped) returning ``.logits`` (B, T, V_d).
        target: causal LM returning ``.logits`` (B, T, V_t); any dtype (logits are cast to
            float32); never updated. V_d and V_t may differ by padding rows.
        examples: dicts with ``prompt_ids`` and ``completion_ids`` (lists of token ids; the
            completion is the target's answer). Loss positions are the positions whose next
            token is a completion token. Sequences longer than ``max_seq_len`` are cut: the
            prompt loses tokens from the left (keeping at least half the window when the
            completion is long), the completion from the right. Examples left without a
            completion position are skipped with a warning.
        settings: ``distill.*`` (:class:`distill.config.DistillConfig`, range-checked when built). The
            loop reads: ``loss``, ``jsd_beta``, ``temperature`` (the divergence, see
            :func:`distill.training.losses.distillation_loss`); ``lr`` (peak); ``max_steps`` (optimizer
            steps in total, resumed ones included); ``batch_size`` (examples per micro-batch);
            ``grad_accum`` (micro-batches per step); ``max_seq_len`` (prompt + completion tokens);
            ``warmup_steps``; ``weight_decay`` (AdamW, decoupled); ``seed`` (data order and, on a fresh
            start, ``accelerate.utils.set_seed``); ``checkpoint_every`` (0 = only at the end; the last
            step always saves); ``keep_checkpoints`` (newest N kept, 0 = all; older ones are deleted
            after a newer one is complete); ``validate_every``; ``mixed_precision``; ``packing`` (micro-batches
            packed into dense rows, the same loss: :mod:`distill.training.packing`; None packs where both
            models keep packed examples apart and pads otherwise, True refuses such a model with DraftsmithError); ``on_policy_fraction`` and ``on_policy_temperature``;
            ``parallel`` (ddp or fsdp). The other fields (method, LoRA, resume, target_source) are the
            caller's: they decide the drafter, ``resume_from`` and the examples handed in.
        output_dir: folder for ``metrics.jsonl`` and checkpoints (created).
        resume_from: a ``checkpoint-<step>`` folder of an earlier run with the same examples,
            seed, batch_size and grad_accum; ``drafter`` must be built the same way (its
            weights are overwritten from the checkpoint). ``max_steps`` and ``warmup_steps`` may
            change (the schedule is re-evaluated at the saved step, so a finished run can be
            extended); the peak ``lr`` is the checkpoint's (it lives in the scheduler state).
        val_examples: held-out examples; if given, :func:`validate` runs before and after.
        Validation (with ``val_examples``; ``settings.validate_every`` N > 0 adds every N optimizer
            steps): every validation (step 0 = before, the last step = after) is a line of
            ``output_dir/validation.jsonl``: ``step``, ``val_loss``, ``val_expected_acceptance``,
            ``val_top1_agreement`` (and ``val_simulated_tau``, ``val_simulated_acceptance``); the logger
            gets the same figures. The curve shows where more steps stop helping (the training loss
            keeps falling when a small dataset is memorised).
        validation_draft_length: K > 0 adds the greedy decoder's exact tau and acceptance at K on the
            validation answers (:func:`simulated_validation`): the quantity evaluate reports, on other prompts.
        pad_token_id: id used to right-pad (masked out everywhere); default: the target's
            ``config.pad_token_id``, else its ``eos_token_id``, else 0.
        logger: optional object with ``log(metrics: dict, step: int)``.
        progress: show a tqdm bar (loss, completion tokens/s, expected acceptance).
        ``settings.mixed_precision`` (``"no"``, ``"bf16"``, ``"fp16"`` or ``"auto"``): accelerate runs the drafter's
            forward under autocast (weights and optimizer stay float32). bf16 is about 2x faster on
            CPUs with AMX/AVX512-BF16 and on GPUs, and ~40x slower in the backward pass on CPUs
            without them (a scalar fallback); ``"auto"`` picks bf16 only where
            :func:`distill.hardware.bf16_is_fast` (the CPU's avx512_bf16 or amx_bf16 units).
        ``settings.on_policy_fraction``: lambda of GKD (Agarwal et al. 2024, Algorithm 1), in [0, 1]: each
            micro-batch is, with this probability, answered by the drafter itself (sampled at
            ``on_policy_temperature``, as many new tokens as the longest stored answer of the
            batch) and the target scores those tokens; otherwise the stored answers are used.
            The draw is seeded by (seed, step, micro-batch), so a resumed run repeats it.
            Needs the online target (``target`` not None) and a divergence loss (not ``"ce"``).
        ``settings.on_policy_temperature``: > 0, the drafter's sampling temperature for on-policy answers.
        eos_token_ids: ids that end an on-policy answer (default: the drafter's
            ``generation_config.eos_token_id``).

    Stored targets: when the examples carry ``top_k_ids``/``top_k_logprobs``
    (``generate.store_top_k``), the loss uses them instead of a target forward
    (:func:`distill.training.losses.top_k_distillation_loss`) and ``target`` may be None.

    Returns:
        ``steps``, ``final_loss``, ``mean_loss_last_10`` (plain mean over the last 10 steps),
        ``tokens_seen`` (completion tokens, including resumed steps), ``train_s`` and
        ``tokens_per_s`` (this call only), ``checkpoint`` (path of the last checkpoint), and
        with ``val_examples``: ``val_loss_before/after``, ``val_expected_acceptance_before/after``,
        ``val_top1_agreement_before/after``.

    Raises:
        DraftsmithError: non-finite loss (names the step), no usable example, no trainable
            parameter, a checkpoint that does not match the run (or was written under the other
            ``parallel``), or an accelerator that does not run ``parallel`` as asked (FSDP without CUDA or
            a launcher, or an FSDP launch with ``parallel="ddp"``).
        DiskFullError: the disk cannot hold one checkpoint (before training), or filled up while
            one was written (the earlier checkpoints are intact).
        ValueError: an argument out of range.
    """
    _WARNED.clear()  # once per training run (a multirun sweep runs its jobs in one process)
    d = settings
    spec = LossSpec(d.loss, d.jsd_beta, d.temperature)
    _check_target_source(examples, target, d.loss, d.on_policy_fraction, d.on_policy_temperature)
    d = replace(d, packing=_resolve_packing(d.packing, drafter, target))
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if pad_token_id is None:
        pad_token_id = _default_pad_id(target if target is not None else drafter)
    # 1. setup: accelerator, optimizer, schedule, data stream, the checkpoint's state
    run = _setup(drafter, target, examples, spec=spec, lr=d.lr, max_steps=d.max_steps, batch_size=d.batch_size,
                 grad_accum=d.grad_accum, max_seq_len=d.max_seq_len, warmup_steps=d.warmup_steps,
                 weight_decay=d.weight_decay, seed=d.seed, resume_from=resume_from, pad_token_id=pad_token_id,
                 mixed_precision=d.mixed_precision, gradient_checkpointing=d.gradient_checkpointing,
                 parallel=d.parallel, lr_schedule=d.lr_schedule)
    # every process checks (a refusal on the main one alone would leave the others waiting for it)
    check_checkpoint_space(run.plain, output_dir, start_step=run.start_step,
                            max_steps=d.max_steps, checkpoint_every=d.checkpoint_every, keep=d.keep_checkpoints,
                            checkpoint_at=d.checkpoint_at,
                            warn=run.accelerator.is_main_process)
    val_args = dict(loss=d.loss, jsd_beta=d.jsd_beta, temperature=d.temperature, batch_size=d.batch_size,
                    max_seq_len=d.max_seq_len, pad_token_id=pad_token_id, draft_length=validation_draft_length)
    sink = _Sink(output_dir, logger, progress, run.start_step, d.max_steps, run.accelerator.is_main_process)
    # 2. validate the untrained drafter, 3. train and save; the bar moves inside long steps too
    with heartbeat(sink.bar, drafter=run.drafter, target=target):
        before, result = _validation_before(run, target, val_examples, val_args, sink)
        train_s, seen, checkpoint = _train_steps(run, target, d, spec, sink, before, resume_from,
                                                 output_dir=output_dir, val_examples=val_examples,
                                                 val_args=val_args, pad_token_id=pad_token_id,
                                                 eos_token_ids=eos_token_ids)
    if is_fsdp2(run.accelerator):
        # the caller's drafter gets the trained weights (FSDP trained a sharded copy), before the validation's
        # forward leaves the unsharded tail modules holding their bf16 compute copies
        copy_sharded_weights(run.drafter, run.plain)
    if val_examples:
        after = _validation_after(run, target, val_examples, val_args, progress)
        result.update(_prefixed(after, "after"))
        if "simulated_tau" in after:
            result["val_simulated_draft_length"] = validation_draft_length
        if d.max_steps > run.start_step:  # a run that trained: the last point of the curve
            sink.validation(d.max_steps, after)
    # Drop accelerate's autocast wrapper from the drafter's forward: callers save and decode with it.
    run.accelerator.unwrap_model(run.drafter, keep_fp32_wrapper=False)
    result.update(_summary(sink.losses, max(d.max_steps, run.start_step), seen, train_s, checkpoint))
    result["packing"] = d.packing  # what distill.packing=null became for these models
    return result


def _validation_before(run: "_TrainingSetup", target, val_examples, val_args: dict, sink: "_Sink"
                       ) -> tuple[dict | None, dict[str, Any]]:
    """The untrained drafter's validation (``val_*_before``; None without validation examples) and the result
    dict it starts; a fresh run's goes to the curve as step 0. A resumed run reports the validation its
    checkpoint carries, not one of the half-trained drafter it restarts from."""
    result: dict[str, Any] = {}
    before: dict | None = None
    if val_examples:
        before = (run.state or {}).get("validation_before")
        if before is None:
            before = _prefixed(validate(run.drafter, target, val_examples, **val_args), "before")
        result.update(before)
    if before is not None and run.start_step == 0:  # "val_loss_before" -> "loss": the curve's step 0
        sink.validation(0, {k[len("val_"):-len("_before")]: v for k, v in before.items()})
    return before, result


def _validation_after(run: "_TrainingSetup", target, val_examples, val_args: dict, progress: bool) -> dict:
    """:func:`validate` on the trained drafter, under a bar of its own that moves inside the pass (the training
    bar is closed by then)."""
    bar = tqdm(total=1, desc="distill: validating the trained drafter", unit="pass",
               disable=not (progress and run.accelerator.is_main_process))
    with heartbeat(bar, drafter=run.drafter, target=target):
        after = validate(run.drafter, target, val_examples, **val_args)
    bar.update(1)
    bar.close()
    return after


def _train_steps(run: "_TrainingSetup", target, d: DistillConfig, spec: LossSpec, sink: "_Sink",
                 before: dict | None, resume_from, *, output_dir: Path, val_examples, val_args: dict, pad_token_id: int,
                 eos_token_ids) -> tuple[float, dict, Path | None]:
    """Steps ``run.start_step + 1 .. d.max_steps``, each with its checkpoint and validation where due; returns
    (seconds, examples and tokens seen, the last checkpoint). The bar is closed and the data stream ended on
    leaving, also on an error."""
    batches = iter(run.loader)  # before restoring the RNG: creating an iterator may draw from it
    if run.state is not None:
        set_rng_state(rng_state_to_resume(run.state, run.accelerator.process_index, run.accelerator.num_processes))
    if run.start_step >= d.max_steps:
        log.warning("the checkpoint is at step %d, at or past max_steps=%d: nothing left to train (raise "
                    "distill.max_steps to continue)", run.start_step, d.max_steps)
    seen = {"examples": run.examples_seen, "tokens": run.tokens_seen, "this_call": 0}
    checkpoint = Path(resume_from) if resume_from is not None else None
    t_start = time.perf_counter()
    try:
        for step in range(run.start_step + 1, d.max_steps + 1):
            record = _optimizer_step(run, target, batches, step, d, spec, seen, checkpoint,
                                     pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)
            sink.step(record)
            if checkpoint_due(step, max_steps=d.max_steps, checkpoint_every=d.checkpoint_every,
                              checkpoint_at=d.checkpoint_at):
                checkpoint = save_checkpoint(run, output_dir, step=step, examples_seen=seen["examples"],
                                              tokens_seen=seen["tokens"], validation_before=before)
                if d.keep_checkpoints and run.accelerator.is_main_process:
                    prune_checkpoints(output_dir, d.keep_checkpoints, protected=d.checkpoint_at)
            if val_examples and d.validate_every and step % d.validate_every == 0 and step < d.max_steps:
                sink.validation(step, validate(run.drafter, target, val_examples, **val_args))
    finally:
        train_s = time.perf_counter() - t_start
        sink.close()
        run.loader.end()  # the stream is infinite: tell accelerate we left it
        run.accelerator.free_memory()
    return train_s, seen, checkpoint


def _summary(history: list[float], steps: int, seen: dict, train_s: float, checkpoint: Path | None) -> dict:
    """The run's closing figures: losses, tokens, seconds of training, tokens/s of this call, last checkpoint."""
    return {
        "steps": steps,
        "final_loss": history[-1] if history else float("nan"),
        "mean_loss_last_10": float(np.mean(history[-10:])) if history else float("nan"),
        "tokens_seen": seen["tokens"],
        "train_s": train_s,
        "tokens_per_s": seen["this_call"] / train_s if train_s > 0 else 0.0,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
    }


def _optimizer_step(run: _TrainingSetup, target, batches, step: int, d: DistillConfig, spec: LossSpec,
                    seen: dict, checkpoint: Path | None, *, pad_token_id: int,
                    eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """2. the loss step: ``grad_accum`` micro-batches (some answered on-policy), one optimizer step.

    Returns the step's record (loss, lr, tokens, tokens/s, expected acceptance, top-1 agreement, gradient
    norm: all processes together) and advances ``seen`` (examples, tokens, this call's tokens).
    """
    accelerator, drafter = run.accelerator, run.drafter
    t0, lr_now, grad_norm = time.perf_counter(), run.scheduler.get_last_lr()[0], float("nan")
    micro_batches = [next(batches) for _ in range(d.grad_accum)]
    if d.on_policy_fraction > 0:
        micro_batches = [
            _on_policy_batch(accelerator.unwrap_model(drafter), batch, pad_token_id=pad_token_id,
                             eos_token_ids=eos_token_ids, temperature=d.on_policy_temperature,
                             max_seq_len=d.max_seq_len)
            if _draw(d.seed, step, i) < d.on_policy_fraction else batch
            for i, batch in enumerate(micro_batches)]
    if d.packing:  # after the on-policy draw: generation needs the padded prompts
        micro_batches = [pack_batch(b, max_seq_len=d.max_seq_len, pad_token_id=pad_token_id) for b in micro_batches]
    step_tokens = sum(int(b["loss_mask"].sum()) for b in micro_batches)
    # DDP averages gradients over processes: weighting by the tokens of *all* processes (times
    # their number) makes the synchronised step the token-weighted mean over every process's tokens
    all_tokens = int(_sum_over_processes(accelerator, [step_tokens])[0])
    loss_sum = accept_sum = agree_sum = 0.0
    for batch in micro_batches:
        with accelerator.accumulate(drafter), _memory_guard(step, batch, d.batch_size, d.grad_accum, checkpoint):
            loss_value, accept, agree = _loss_step(drafter, target, batch, spec)
            _check_finite("distillation loss", loss_value.item(), step, checkpoint)
            tokens = int(batch["loss_mask"].sum())
            # accelerate divides by grad_accum; this makes the step the token-weighted mean
            accelerator.backward(loss_value * (tokens * d.grad_accum * accelerator.num_processes
                                               / max(all_tokens, 1)))
            if accelerator.sync_gradients:
                grad_norm = float(accelerator.clip_grad_norm_(run.params, MAX_GRAD_NORM))
                _check_finite("gradient norm", grad_norm, step, checkpoint)
                run.optimizer.step()
                run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=True)
        loss_sum += loss_value.item() * tokens
        accept_sum += accept
        agree_sum += agree
    # figures of the whole step, all processes together (the stream advances by all their batches)
    loss_sum, accept_sum, agree_sum = _sum_over_processes(accelerator, [loss_sum, accept_sum, agree_sum])
    seen["examples"] += d.batch_size * d.grad_accum * accelerator.num_processes
    seen["tokens"] += all_tokens
    seen["this_call"] += all_tokens
    return {"step": step, "loss": loss_sum / max(all_tokens, 1), "lr": lr_now, "tokens": all_tokens,
            "tokens_per_s": all_tokens / max(time.perf_counter() - t0, 1e-9),
            "expected_acceptance": accept_sum / max(all_tokens, 1),
            "top1_agreement": agree_sum / max(all_tokens, 1), "grad_norm": grad_norm}


class _Sink:
    """Where a run's figures go: ``metrics.jsonl``, ``validation.jsonl``, the logger and the progress bar.

    Only the main process writes, logs and shows the bar; on the others (DDP) every call does nothing but
    keep the loss history, which is the same on every process (the records hold all processes' figures).
    On a resumed run the files keep the lines up to the checkpoint's step, so one run holds the whole curve.
    """

    def __init__(self, output_dir: Path, logger: Any, progress: bool, start_step: int, max_steps: int,
                 is_main: bool) -> None:
        self.is_main = is_main
        self.validation_path = output_dir / VALIDATION_FILE
        kept = _keep_steps_up_to(output_dir / METRICS_FILE, start_step, write=is_main, create=True)
        self.losses = [r["loss"] for r in kept]
        _keep_steps_up_to(self.validation_path, start_step, write=is_main)
        self.metrics = (output_dir / METRICS_FILE).open("a", encoding="utf-8") if is_main else None
        self.logger = logger if is_main else None
        self.bar = tqdm(total=max_steps, initial=start_step, disable=not (progress and is_main), desc="distill",
                        unit="step", dynamic_ncols=True)

    def step(self, record: dict) -> None:
        self.losses.append(record["loss"])
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.logger is not None:
            self.logger.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                             acc=f"{record['expected_acceptance']:.3f}")

    def validation(self, step: int, figures: dict) -> None:
        record = {"step": step, **{f"val_{k}": v for k, v in figures.items() if k in _VAL_FIGURES}}
        if not self.is_main:
            return
        with self.validation_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.logger is not None:
            self.logger.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if not self.bar.disable:
            self.bar.write(f"validation at step {step}: " + ", ".join(
                f"{k[4:]} {v:.4f}" for k, v in record.items() if k != "step"))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.bar.close()


@torch.no_grad()
def validate(
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    examples: Sequence[dict],
    *,
    loss: str = "fkl",
    jsd_beta: float = 0.5,
    temperature: float = 1.0,
    batch_size: int = 4,
    max_seq_len: int = 512,
    pad_token_id: int | None = None,
    draft_length: int = 0,
) -> dict[str, float]:
    """Held-out distillation loss and expected acceptance, without decoding.

    Teacher-forced on the examples' completions (the target's answers), so it measures how
    well the drafter matches the target where the target actually goes, at the cost of two
    forwards per batch. ``expected_acceptance`` is the token-weighted mean of
    ``sum_v min(p_v, q_v)`` (Leviathan et al. 2023, Cor. 3.6) at ``temperature``: the
    acceptance rate speculative *sampling* would see, a proxy for the measured rate
    (greedy decoding accepts on argmax agreement instead).

    Args:
        drafter, target: as in :func:`train_drafter`; both are put in eval mode for the call
            and restored afterwards.
        examples: dicts with ``prompt_ids`` and ``completion_ids``.
        loss, jsd_beta, temperature, batch_size, max_seq_len, pad_token_id: as in training.
        draft_length: K > 0 adds the greedy decoder's exact figures at K on these answers when they are
            greedy (``temperature`` 0 in the examples): :func:`simulated_validation`.

    Returns:
        ``{"loss": nats/token, "expected_acceptance": in [0, 1], "top1_agreement": in [0, 1] (share
        of positions where the drafter's argmax is the target's: what greedy decoding accepts on),
        "tokens": completion tokens, "examples": examples used}``, with ``draft_length`` also
        ``simulated_tau`` and ``simulated_acceptance``.

    Raises:
        DraftsmithError: no example has a completion position.
    """
    spec = LossSpec(loss, jsd_beta, temperature)
    examples = _usable_examples(examples, max_seq_len, "validation")
    pad_token_id = _default_pad_id(target if target is not None else drafter) if pad_token_id is None else pad_token_id
    was_training = drafter.training
    drafter.eval()
    loss_sum = accept_sum = agree_sum = 0.0
    tokens = 0
    try:
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start:start + batch_size], pad_token_id=pad_token_id, max_seq_len=max_seq_len)
            batch = {k: v.to(_device(drafter)) for k, v in batch.items()}
            n = int(batch["loss_mask"].sum())
            loss_value, accept, agree = _loss_step(drafter, target, batch, spec)
            loss_sum += loss_value.item() * n
            accept_sum += accept
            agree_sum += agree
            tokens += n
        simulated = simulated_validation(drafter, examples, draft_length) if draft_length else {}
    finally:
        drafter.train(was_training)
    return {"loss": loss_sum / tokens, "expected_acceptance": accept_sum / tokens,
            "top1_agreement": agree_sum / tokens, "tokens": tokens, "examples": len(examples), **simulated}


def simulated_validation(drafter, examples: Sequence[dict], draft_length: int) -> dict[str, float]:
    """tau and acceptance rate that greedy speculative decoding at K = ``draft_length`` gets on the examples'
    answers, exactly (``decode.acceptance.simulate_greedy`` on one teacher-forced drafter pass), or {} when the
    answers were sampled (``temperature`` > 0: greedy decoding would not emit them). Exact only when the target
    wrote the answers greedily; on scored answers (``generate.answers=dataset``) the blocks are replayed on text
    the target did not write, a proxy that tracks training (report.md labels it so). The drafter runs as it
    trains (its training dtype, no int8), so evaluate's int8 figures can differ by a near-tie here and there.
    """
    if any(e.get("temperature", 0.0) > 0 for e in examples):
        return {}
    prompts = [list(e["prompt_ids"]) for e in examples]
    answers = [list(e["completion_ids"]) for e in examples]
    model = getattr(drafter, "module", drafter)  # DDP's wrapper forwards neither config nor keyword calls' fields
    vocab = model.get_output_embeddings().out_features
    # few rows at a time: the training device also holds the optimizer state, and logits are (rows, vocab) float32
    predictions = drafter_predictions(model, prompts, answers, vocab_size=vocab, batch_tokens=1024, progress=False)
    blocks = []
    for example, prompt, answer, (tokens, probs) in zip(examples, prompts, answers, predictions):
        # an answer cut by generate's limit ends the decoder there; one that ended with EOS ran free
        limit = len(answer) + (0 if example.get("finish_reason") == "length" else draft_length + 1)
        blocks.append(simulate_greedy(TeacherForced("", "", prompt, answer, tokens, probs),
                                      draft_length=draft_length, max_new_tokens=limit))
    pooled = DecodeStats.merge(blocks)
    return {"simulated_tau": pooled.mean_accepted_tokens, "simulated_acceptance": pooled.acceptance_rate}


def collate(examples: Sequence[dict], *, pad_token_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of prompt + completion sequences.

    Returns ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) int64, ``labels`` (B, T) int64
    (the next token; ``pad_token_id`` at the last position) and ``loss_mask`` (B, T) bool, True
    at the positions whose next token is a completion token (prompt and padding masked).
    T is the longest sequence in the batch after truncation to ``max_seq_len``. When the
    examples carry ``top_k_ids``/``top_k_logprobs`` (``generate.store_top_k``), also
    ``top_k_ids`` (N, k) int64 and ``top_k_logprobs`` (N, k) float32 for the N = ``loss_mask.sum()``
    loss positions in row-major order (the order of ``labels[loss_mask]``).
    """
    seqs, prompt_lens, top_ids, top_logprobs = [], [], [], []
    stored = [ex.get("top_k_ids") is not None for ex in examples]
    if any(stored) and not all(stored):
        raise DraftsmithError("some examples carry stored top-k target log-probabilities and some do not: "
                              "regenerate the data with one generate.store_top_k")
    for ex in examples:
        prompt, completion = _truncate(list(ex["prompt_ids"]), list(ex["completion_ids"]), max_seq_len)
        seqs.append(prompt + completion)
        prompt_lens.append(len(prompt))
        if all(stored) and examples:
            # row j is the target's distribution over completion token j; the loss positions of
            # this sequence predict completion tokens 0..len-1 in order (row-major, as labels[mask])
            top_ids.append(torch.as_tensor(ex["top_k_ids"][:len(completion)], dtype=torch.long))
            top_logprobs.append(torch.as_tensor(ex["top_k_logprobs"][:len(completion)], dtype=torch.float32))
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (seq, prompt_len) in enumerate(zip(seqs, prompt_lens)):
        ids = torch.tensor(seq, dtype=torch.long)
        input_ids[i, :len(seq)] = ids
        labels[i, :len(seq) - 1] = ids[1:]
        attention_mask[i, :len(seq)] = 1
        loss_mask[i, max(prompt_len - 1, 0):len(seq) - 1] = True
        if top_ids:  # an empty prompt has no position before its first completion token
            skip = len(seq) - 1 - max(prompt_len - 1, 0)
            top_ids[i], top_logprobs[i] = top_ids[i][-skip:] if skip else top_ids[i][:0], \
                top_logprobs[i][-skip:] if skip else top_logprobs[i][:0]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "loss_mask": loss_mask}
    if top_ids:
        batch["top_k_ids"] = torch.cat(top_ids)  # (N, k), N = loss_mask.sum()
        batch["top_k_logprobs"] = torch.cat(top_logprobs)
    return batch


# ---------------------------------------------------------------------------------------------
# setup


@dataclass
class _TrainingSetup:
    accelerator: Any
    drafter: torch.nn.Module
    optimizer: Any
    scheduler: Any
    loader: Any
    params: list
    state: dict | None
    start_step: int
    examples_seen: int
    tokens_seen: int
    data_key: dict
    plain: torch.nn.Module  # the caller's drafter, an ordinary model: what checkpoints save


def _setup(drafter, target, examples, *, spec, lr, max_steps, batch_size, grad_accum, max_seq_len,
           warmup_steps, weight_decay, seed, resume_from, pad_token_id, mixed_precision="no",
           gradient_checkpointing=False, parallel="ddp", lr_schedule="linear") -> _TrainingSetup:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    examples = _usable_examples(examples, max_seq_len, "training")
    mixed_precision = resolve_mixed_precision(mixed_precision)
    accelerator = Accelerator(**accelerator_kwargs(parallel, grad_accum=grad_accum, mixed_precision=mixed_precision))
    _check_processes(accelerator)
    _check_parallel(accelerator, parallel)
    data_key = {"seed": seed, "batch_size": batch_size, "grad_accum": grad_accum,
                "num_examples": len(examples), "max_seq_len": max_seq_len,
                # each process takes its own batches: N processes make a step of N * batch_size * grad_accum
                "num_processes": accelerator.num_processes}
    state = None
    if resume_from is not None:
        state = read_state(Path(resume_from), data_key)
        check_resume_parallel(state, Path(resume_from), parallel)
        load_weights(drafter, Path(resume_from))
    else:
        set_seed(seed)
    if target is not None:
        _place_target(target, accelerator.device)
        target.eval()
    if gradient_checkpointing:
        # non-reentrant: gradients reach LoRA weights although the frozen embeddings' output needs none
        drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    drafter.train()
    # FSDP2 shards the module it prepares in place: it trains a copy, and the caller's drafter stays an
    # ordinary model that checkpoints and the end of training fill with the gathered weights
    plain, drafter = drafter, (copy.deepcopy(drafter) if is_fsdp2(accelerator) else drafter)

    params = [p for p in drafter.parameters() if p.requires_grad]
    if not params:
        raise DraftsmithError("the drafter has no trainable parameter: build it with lora settings "
                              "or without freezing it")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, max_steps) if lr_schedule == "linear" \
        else get_constant_schedule_with_warmup(optimizer, warmup_steps)
    examples_seen = state["examples_seen"] if state else 0
    loader = DataLoader(
        examples, batch_size=batch_size,
        sampler=_StreamSampler(len(examples), seed, start=examples_seen),
        collate_fn=partial(collate, pad_token_id=pad_token_id, max_seq_len=max_seq_len),
        generator=torch.Generator().manual_seed(seed))
    # The scheduler is stepped by hand once per optimizer step (accelerate's prepared scheduler
    # would step once per process).
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    params = [p for p in drafter.parameters() if p.requires_grad]  # FSDP2 swapped in sharded parameters
    if state is not None:
        load_optimizer_state(accelerator, drafter, optimizer, Path(resume_from))
        scheduler.load_state_dict(torch.load(Path(resume_from) / "scheduler.pt", map_location="cpu",
                                             weights_only=True))
        # re-evaluate the lr at the saved step under *this* schedule (max_steps may have grown)
        scheduler.last_epoch -= 1
        scheduler.step()
    return _TrainingSetup(accelerator, drafter, optimizer, scheduler, loader, params, state,
                start_step=state["step"] if state else 0, examples_seen=examples_seen,
                tokens_seen=state["tokens_seen"] if state else 0, data_key=data_key, plain=plain)


class _StreamSampler(Sampler[int]):
    """Endless example order: epoch e is ``default_rng([seed, e]).permutation(n)``, from ``start``."""

    def __init__(self, num_examples: int, seed: int, start: int = 0) -> None:
        self.num_examples, self.seed, self.start = num_examples, seed, start

    def __iter__(self):
        epoch, offset = divmod(self.start, self.num_examples)
        while True:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            yield from order[offset:].tolist()
            epoch, offset = epoch + 1, 0


_WARNED: set[tuple] = set()  # validation runs every validate_every steps: say each thing once


def _warn_once(message: str, *args) -> None:
    if (message, args) not in _WARNED:
        _WARNED.add((message, args))
        log.warning(message, *args)


def _usable_examples(examples: Sequence[dict], max_seq_len: int, what: str = "training") -> list[dict]:
    usable, cut = [], 0
    for ex in examples:
        prompt, completion = _truncate(list(ex["prompt_ids"]), list(ex["completion_ids"]), max_seq_len)
        cut += len(prompt) < len(ex["prompt_ids"]) or len(completion) < len(ex["completion_ids"])
        if len(prompt) + len(completion) - 1 - max(len(prompt) - 1, 0) > 0:
            kept = {"prompt_ids": prompt, "completion_ids": completion}
            if ex.get("top_k_ids") is not None:
                kept.update(top_k_ids=ex["top_k_ids"][:len(completion)],
                            top_k_logprobs=ex["top_k_logprobs"][:len(completion)])
            usable.append(kept)
    if not usable:
        raise DraftsmithError(f"none of the {len(examples)} examples has a completion token to learn "
                              "from: check the generate stage output (empty answers?) or raise max_seq_len")
    if len(usable) < len(examples):
        _warn_once("skipping %d of %d %s examples without completion tokens", len(examples) - len(usable),
                   len(examples), what)
    if cut:
        # the drafter then learns from a cut context (stored target log-probs saw the whole prompt)
        _warn_once("%d of %d %s examples are longer than max_seq_len=%d and were cut (prompt from the left, "
                   "answer from the right): raise distill.max_seq_len to train on whole examples", cut,
                   len(examples), what, max_seq_len)
    return usable


def _truncate(prompt: list[int], completion: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Fit prompt + completion into ``max_seq_len``: the prompt keeps its last tokens (at least
    half the window when the completion is long), the completion its first ones."""
    if len(prompt) + len(completion) <= max_seq_len:
        return prompt, completion
    prompt_keep = min(len(prompt), max(max_seq_len - len(completion), max_seq_len // 2))
    return prompt[len(prompt) - prompt_keep:], completion[:max_seq_len - prompt_keep]


# ---------------------------------------------------------------------------------------------
# loss step


def _loss_step(drafter, target, batch: dict, spec: LossSpec) -> tuple[torch.Tensor, float, float]:
    """One forward of both models on ``batch`` (of the drafter only, when the batch carries the
    target's stored top-k log-probabilities: :func:`distill.training.losses.top_k_distillation_loss`).

    Both LM heads run only at the ``N`` masked (completion) positions (``logits_to_keep`` as a
    boolean mask), so logits are ``(N, V)`` rather than ``(B, T, V)``: with a 152k vocabulary the
    head, the softmaxes and the loss dominate a step otherwise.

    Returns the drafter's loss (0-dim, with graph if grad is on; mean over ``loss_mask``), the
    *sum* of expected acceptance over the masked positions (float) and the *count* of positions
    where the drafter's most likely token is the target's (float): greedy decoding accepts a draft
    token exactly when they agree, so this is the greedy acceptance proxy.
    """
    # a packed batch (distill.training.packing) has position_ids and no attention_mask
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    keep = batch["loss_mask"]
    if "top_k_ids" in batch:  # stored target distributions: no target forward at all
        return _stored_top_k_loss_step(drafter, inputs, batch, spec)
    with torch.no_grad():
        target_device = _device(target)
        target_logits = target(**{k: v.to(target_device) for k, v in inputs.items()}, use_cache=False,
                               logits_to_keep=keep.to(target_device)).logits
    student_logits = drafter(**inputs, use_cache=False, logits_to_keep=keep).logits
    # (N, V) -> (1, N, V): the loss functions take (B, T, V) with a (B, T) mask.
    student_logits = student_logits.unsqueeze(0)
    target_logits = target_logits.to(student_logits.device).unsqueeze(0)
    mask = torch.ones(student_logits.shape[:2], dtype=torch.bool, device=student_logits.device)
    labels = batch["labels"][keep].unsqueeze(0)
    # full vocabulary: a reduced drafter has q = 0 outside its set
    full_vocab_logits = student_logits, target_logits, mask
    if (draft_ids := draft_vocabulary_of(drafter)) is not None:  # EAGLE-3: the loss on the draft vocabulary only
        student_logits, target_logits, labels, mask = restrict_logits(
            student_logits, target_logits, draft_ids, labels=labels if spec.kind == "ce" else None, mask=mask)
    loss = distillation_loss(student_logits, target_logits, mask, kind=spec.kind,
                             jsd_beta=spec.jsd_beta, temperature=spec.temperature, labels=labels)
    with torch.no_grad():
        accept = expected_acceptance(full_vocab_logits[0].detach(), *full_vocab_logits[1:],
                                     temperature=spec.temperature).sum().item()
        agree = float((full_vocab_logits[0].argmax(-1) == full_vocab_logits[1].argmax(-1)).sum())
    return loss, accept, agree


def _stored_top_k_loss_step(drafter, inputs: dict, batch: dict, spec: LossSpec) -> tuple[torch.Tensor, float, float]:
    """:func:`_loss_step` against the target's stored top-k: a reduced drafter's logits stay on its
    draft vocabulary ``(N, D)`` (the loss maps the stored ids), which with a 64k head of 152k saves
    most of the softmax passes; the result is the same as on full ``(N, V)`` logits."""
    keep = batch["loss_mask"]
    with draft_vocabulary_logits(drafter) as draft_ids:
        student_logits = drafter(**inputs, use_cache=False, logits_to_keep=keep).logits
    device = student_logits.device
    top_k_ids = batch["top_k_ids"].to(device)
    per_token, accept = top_k_distillation_loss(
        student_logits, top_k_ids, batch["top_k_logprobs"].to(device), kind=spec.kind,
        jsd_beta=spec.jsd_beta, temperature=spec.temperature, labels=batch["labels"][keep].to(device),
        draft_to_target=draft_ids)
    if per_token.numel() == 0:
        return student_logits.float().sum() * 0.0, 0.0, 0.0
    best = student_logits.detach().argmax(-1)
    if draft_ids is not None:
        best = draft_ids[best]
    # stored ids are sorted by log-prob (torch.topk), so column 0 is the target's argmax
    agree = (best == top_k_ids[:, 0]).sum()
    return per_token.mean(), accept.sum().item(), float(agree)


# ---------------------------------------------------------------------------------------------
# on-policy data (GKD)


def _draw(seed: int, step: int, micro: int) -> float:
    """Uniform [0, 1) draw for (seed, step, micro-batch): independent of the torch RNG, so a
    resumed run makes the same on-policy choices."""
    return float(np.random.default_rng([seed, step, micro, 7919]).random())


@torch.no_grad()
def _on_policy_batch(drafter, batch: dict, *, pad_token_id: int, eos_token_ids: Sequence[int],
                     temperature: float, max_seq_len: int) -> dict:
    """The batch with its completions replaced by the drafter's own samples (GKD's student data).

    Prompts are the batch's prompt tokens (left-padded for ``generate``); each new answer gets as
    many tokens as the longest stored completion of the batch (within ``max_seq_len``) and stops
    at EOS. Returns a freshly collated batch on the same device (no stored top-k: the target
    scores the new tokens online).
    """
    device = batch["input_ids"].device
    prompts, budget = [], 1
    for ids, mask, keep in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        length = int(mask.sum())
        first = int(keep.nonzero()[0]) + 1 if bool(keep.any()) else length  # first completion token
        prompts.append(ids[:first].tolist())
        budget = max(budget, length - first)
    budget = max(1, min(budget, max_seq_len - max(len(p) for p in prompts)))
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, device=device)
        attention[row, width - len(ids):] = 1
    eos = list(eos_token_ids) or _eos_ids(drafter)
    was_training = drafter.training
    drafter.eval()
    try:
        out = drafter.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=budget,
                               do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                               eos_token_id=eos or None, pad_token_id=pad_token_id)
    finally:
        drafter.train(was_training)
    examples = []
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        examples.append({"prompt_ids": prompt, "completion_ids": row[:end] or [pad_token_id]})
    fresh = collate(examples, pad_token_id=pad_token_id, max_seq_len=max_seq_len)
    return {k: v.to(device) for k, v in fresh.items()}


def _eos_ids(model) -> list[int]:
    config = getattr(model, "generation_config", None)
    value = getattr(config, "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# ---------------------------------------------------------------------------------------------
# logging


def _keep_steps_up_to(path: Path, start_step: int, *, write: bool = True, create: bool = False) -> list[dict]:
    """The records of the JSONL file ``path`` with ``step <= start_step`` (none on a fresh start), and with
    ``write`` the file rewritten to hold only them (created empty where missing only with ``create``).

    ``write=False`` (the non-main processes of a multi-process run) only reads: the main process rewrites
    the file atomically, so a reader sees the old or the new file, and both hold the kept lines.
    """
    kept: list[str] = []
    if start_step > 0 and path.exists():
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= start_step]
    if write and (create or path.exists()):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    return [json.loads(line) for line in kept]


def _prefixed(metrics: dict, when: str) -> dict:
    return {f"val_{name}_{when}": metrics[name] for name in _VAL_FIGURES if name in metrics}


# ---------------------------------------------------------------------------------------------
# save / resume


# ---------------------------------------------------------------------------------------------
# small helpers


def _check_target_source(examples, target, loss: str, on_policy_fraction: float, temperature: float) -> None:
    stored = bool(examples) and examples[0].get("top_k_ids") is not None
    if not 0.0 <= on_policy_fraction <= 1.0:
        raise ValueError(f"on_policy_fraction must be in [0, 1], got {on_policy_fraction}")
    if not temperature > 0:
        raise ValueError(f"on_policy_temperature must be > 0, got {temperature}")
    if target is None and not stored:
        raise ValueError("no target model and no stored top-k target log-probabilities in the examples: "
                         "pass the target, or generate the data with generate.store_top_k > 0")
    if on_policy_fraction > 0 and target is None:
        raise ValueError("on-policy data (on_policy_fraction > 0) needs the online target to score the "
                         "drafter's answers: pass the target (distill.target_source=online)")
    if on_policy_fraction > 0 and loss == "ce":
        raise ValueError("loss 'ce' learns the target's tokens; on-policy answers are the drafter's own: "
                         "use fkl, rkl, jsd or tvd with on_policy_fraction > 0")


@contextlib.contextmanager
def _memory_guard(step: int, batch: dict, batch_size: int, grad_accum: int, checkpoint: Path | None):
    """Turn an out-of-memory failure inside a training step into an error that says what to lower."""
    try:
        yield
    except (MemoryError, RuntimeError) as err:
        asked = out_of_memory_bytes(err)
        if asked is None:
            raise
        shape = tuple(batch["input_ids"].shape)
        size = f" (an allocation of {asked / 2**30:.2f} GiB failed)" if asked else ""
        last = (f"; the last good checkpoint is {checkpoint}, and running the same command again resumes from it"
                if checkpoint is not None else "")
        raise OutOfMemoryError(
            f"out of memory at step {step} on a micro-batch of {shape[0]} x {shape[1]} tokens{size}: lower "
            f"distill.batch_size (now {batch_size}; raise distill.grad_accum, now {grad_accum}, to keep the "
            f"examples per step) or distill.max_seq_len, or use distill.target_source=stored (no target in "
            f"memory) or a reduced drafter.draft_vocab_size{last}") from err


def _check_finite(what: str, value: float, step: int, checkpoint: Path | None = None) -> None:
    """Stop on NaN/inf, naming the step and the last good checkpoint (nothing is trained on garbage)."""
    if not math.isfinite(value):
        last = (f"the last good checkpoint is {checkpoint} (distill.resume={checkpoint} continues from it)"
                if checkpoint is not None else "no checkpoint was written before it")
        raise DraftsmithError(
            f"{what} is {value} at step {step}; {last}. Lower distill.lr, or check the target's logits "
            "(load the target in float32 if bf16/fp16 overflows)")


def _resolve_packing(setting: bool | None, drafter, target) -> bool:
    """Whether micro-batches are packed: ``distill.packing`` true or null (auto), and both models keep packed
    examples apart (:func:`distill.training.packing.check_packing`; a model that attends across them would train
    on another loss, silently). Under null such a model trains padded, with a warning.

    Raises:
        DraftsmithError: ``setting`` is true and a model attends across packed examples.
    """
    if setting is False:
        return False
    try:
        for model, what in ((drafter, "the drafter"), (target, "the target")):
            if model is not None:
                check_packing(model, what)
    except DraftsmithError as error:
        if setting:
            raise
        log.warning("%s; training with padded micro-batches (distill.packing=null)", error)
        return False
    return True


def _default_pad_id(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _check_processes(accelerator) -> None:
    """Refuse a launcher's several processes that accelerate runs as independent single processes.

    On a machine without a GPU, accelerate joins the processes of ``torchrun`` (or of
    ``accelerate launch --multi_gpu``) only with ``ACCELERATE_USE_CPU=1``; otherwise each would
    train alone and all would write the same checkpoints. (``accelerate launch --cpu
    --num_processes N`` starts a single process.)
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        raise DraftsmithError(f"WORLD_SIZE={world} but accelerate runs this process alone: on a machine "
                              "without a GPU set ACCELERATE_USE_CPU=1 for torchrun / accelerate launch --multi_gpu")


def _check_parallel(accelerator, parallel: str) -> None:
    """Refuse an accelerator that does not run ``distill.parallel`` as asked: accelerate drops an FSDP plugin it
    cannot apply (CPUs, a process started without a launcher), and applies one that ``accelerate launch`` brought
    (``ACCELERATE_USE_FSDP``) to a run whose checkpoints expect DDP."""
    from accelerate.utils import DistributedType

    if parallel == "fsdp" and not is_fsdp2(accelerator):
        raise DraftsmithError(fsdp_refusal() or "distill.parallel=fsdp: accelerate did not turn FSDP2 on (distributed "
                              f"type {accelerator.distributed_type.value}): use distill.parallel=ddp")
    if parallel == "ddp" and accelerator.distributed_type == DistributedType.FSDP:
        raise DraftsmithError("accelerate was configured for FSDP (accelerate launch --use_fsdp or ACCELERATE_USE_FSDP"
                              "=true) but distill.parallel=ddp: set distill.parallel=fsdp, or launch without FSDP")


def _sum_over_processes(accelerator, values: list[float]) -> list[float]:
    """``values`` summed over all processes (an all-reduce); unchanged in a single-process run."""
    if accelerator.num_processes == 1:
        return list(values)
    total = accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device), "sum")
    return total.tolist()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _place_target(target: torch.nn.Module, device: torch.device) -> None:
    if getattr(target, "hf_device_map", None) is None and _device(target) != device:
        target.to(device)
