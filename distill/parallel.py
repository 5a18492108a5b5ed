"""One ``draftsmith distill``, ``generate`` or ``evaluate`` run in N launched processes (``torchrun`` /
``accelerate launch``).

A launcher starts the same command N times (``WORLD_SIZE=N``). Only the main process (rank 0) goes
through Hydra: it alone picks (or, with ``distill.resume=auto``, continues) the run folder, takes the
run's lock, writes the manifest, the merged drafter and the logger's output. It joins the others
over ``torch.distributed`` first (accelerate's ``PartialState``: gloo on CPU with
``ACCELERATE_USE_CPU=1``, nccl on GPUs; the ``Accelerator`` in :func:`distill.training.loop.train_drafter`
reuses that process group) and then *broadcasts* what the others need: the checked config, the
run folder, the generate run read, the checkpoint to resume from (:func:`from_main`). A broadcast
needs no clock agreement, no shared scratch file and no launcher-specific id, and it cannot pick up
a stale answer of an earlier launch. A failure on the main process is relayed, so every process
stops with the same error; every process trains, and all meet before the main process saves.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

from distill.errors import DraftsmithError

T = TypeVar("T")


class MainProcessError(DraftsmithError):
    """The main process failed; this process stops with it (the main process reports the cause)."""


def world_size() -> int:
    """The number of processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)
    except ValueError:
        return 1


def launcher_rank() -> int:
    """This process's rank as the launcher set it (``RANK``), before any process group exists."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def _active() -> bool:
    if "torch" not in sys.modules:  # nothing joined yet (e.g. `--help`): do not import torch for nothing
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def start() -> Any:
    """Join the launcher's processes (accelerate's ``PartialState``); returns the state.

    Raises:
        DraftsmithError: accelerate would run each launched process alone (a machine without a GPU
            and without ``ACCELERATE_USE_CPU=1``): every process would train its own copy.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    if state.num_processes != world_size():
        raise DraftsmithError(f"WORLD_SIZE={world_size()} but accelerate runs this process alone: on a machine "
                              "without a GPU set ACCELERATE_USE_CPU=1 for torchrun / accelerate launch --multi_gpu")
    return state


PARALLEL_MODES = ("ddp", "fsdp")


def is_fsdp2(accelerator: Any) -> bool:
    """Whether ``accelerator`` shards with FSDP2 (accelerate's ``is_fsdp2``; accelerate before 1.6 has none)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def fsdp_refusal() -> str | None:
    """Why ``distill.parallel=fsdp`` cannot run in this process, or None where it can: accelerate or torch without
    FSDP2, no CUDA, or no launcher.

    accelerate applies its FSDP plugin only to processes that a launcher started on GPUs; anywhere else it drops
    the plugin without a word (DDP over gloo on CPUs, an unwrapped model in a process started without a launcher),
    so a run asked to shard would quietly hold the whole drafter on every process.
    """
    import dataclasses

    import torch
    import torch.distributed.fsdp as torch_fsdp
    from accelerate.utils import FullyShardedDataParallelPlugin, parse_flag_from_env

    if "fsdp_version" not in {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}:
        return "distill.parallel=fsdp needs accelerate with FSDP2 (1.6 or later): pip install -U accelerate"
    if not hasattr(torch_fsdp, "fully_shard"):
        return "distill.parallel=fsdp needs torch's FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6 or later)"
    if not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU"):
        return ("distill.parallel=fsdp needs CUDA GPUs: accelerate shards with FSDP only on GPUs and would train with "
                "DDP here; on CPU use distill.parallel=ddp")
    if os.environ.get("LOCAL_RANK") is None:
        return ("distill.parallel=fsdp runs in processes started by a launcher (torchrun --nproc_per_node N -m "
                "distill.cli distill ..., or accelerate launch): accelerate leaves a process started without one "
                "unsharded. One process shards nothing: use distill.parallel=ddp there")
    return None


def accelerator_kwargs(parallel: str, *, grad_accum: int, mixed_precision: str) -> dict[str, Any]:
    """Keyword arguments of the training ``accelerate.Accelerator`` for ``distill.parallel``.

    ``ddp``: gradient accumulation and mixed precision only (accelerate wraps the drafter in DDP when several
    processes run, and leaves it alone in one). ``fsdp`` adds accelerate's ``FullyShardedDataParallelPlugin``
    for FSDP2 (``fsdp_version=2``, ``torch.distributed.fsdp.fully_shard``): each decoder layer (the classes in the
    model's ``_no_split_modules``) is its own unit, gathered for its forward and backward and resharded after;
    full (unsharded) state dicts, which is what :mod:`distill.training.checkpoint` saves. With bf16 or fp16 the
    layers are gathered in that dtype for compute and their gradients reduced in float32, as DDP reduces them
    (accelerate's own policy would reduce in the compute dtype); the sharded weights and AdamW stay float32.

    Args:
        parallel: ``ddp`` or ``fsdp``.
        grad_accum: micro-batches per optimizer step.
        mixed_precision: ``no``, ``bf16`` or ``fp16`` (resolved, not ``auto``).

    Raises:
        ValueError: ``parallel`` is not one of ``ddp``, ``fsdp``.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": grad_accum, "mixed_precision": mixed_precision}
    if parallel == "fsdp":
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else None
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            state_dict_type="FULL_STATE_DICT", mixed_precision_policy=policy)
    return kwargs


def restores_fsdp_flag(train: Callable[..., T]) -> Callable[..., T]:
    """``train`` with ``ACCELERATE_USE_FSDP`` set back to what it was (or unset) when it returns or raises.

    accelerate sets that variable for good in the process once an ``Accelerator`` is given an FSDP plugin, reads
    it while training (gradient clipping) and transformers reads it when loading a model; a later run in the
    same process (a sweep's next job, a test) would otherwise be taken for an FSDP one."""

    @functools.wraps(train)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        before = os.environ.get("ACCELERATE_USE_FSDP")
        try:
            return train(*args, **kwargs)
        finally:
            if before is None:
                os.environ.pop("ACCELERATE_USE_FSDP", None)
            else:
                os.environ["ACCELERATE_USE_FSDP"] = before

    return wrapper


def rank_and_size() -> tuple[int, int]:
    """``(this process's rank, number of processes)`` of the joined process group; ``(0, 1)`` without one."""
    if not _active():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    """True in a single-process run and on the main process of several."""
    if not _active():
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0


def from_main(compute: Callable[[], T] | None) -> T:
    """``compute()`` run on the main process only, its result (picklable) broadcast to all processes.

    Without several processes this is just ``compute()``. When ``compute`` raises on the main
    process, the error is raised there and relayed to the others (a :class:`DraftsmithError` as is,
    marked ``relayed=True``; anything else as :class:`MainProcessError`), so no process waits forever.
    Also a barrier: no process returns before the main process has finished ``compute``.
    """
    if not _active():
        return compute()
    from accelerate.utils import broadcast_object_list

    if is_main():
        try:
            payload = [("ok", compute())]
        except BaseException as err:
            relayed = err if isinstance(err, DraftsmithError) else \
                MainProcessError(f"the main process failed: {type(err).__name__}: {err}")
            try:
                broadcast_object_list([("error", relayed)])
            except Exception:  # noqa: BLE001 - an unpicklable error: still let the others stop
                broadcast_object_list([("error", MainProcessError(f"the main process failed: {err!r}"))])
            raise
        broadcast_object_list(payload)
        return payload[0][1]
    payload = broadcast_object_list([None])
    kind, value = payload[0]
    if kind == "error":
        value.relayed = True
        raise value
    return value


def merged_parts(items: list) -> list:
    """Every process's ``items`` merged entry by entry, on every process: each process filled its own entries
    and left the others None (``items`` as is without several processes).

    Raises:
        ValueError: the processes' lists differ in length.
    """
    if not _active():
        return items
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    if any(len(p) != len(items) for p in parts):
        raise ValueError(f"merged_parts: lists of lengths {[len(p) for p in parts]} from the processes")
    return [next((p[i] for p in parts if p[i] is not None), None) for i in range(len(items))]


def barrier() -> None:
    """Wait until every process gets here (nothing without several processes)."""
    if _active():
        import torch.distributed as dist

        dist.barrier()


def finish(ok: bool = True) -> None:
    """Leave the process group before exit; with ``ok`` (no error) after all processes got here, so they
    end together. Without ``ok`` there is no wait: another process may be stuck in a collective, and the
    launcher stops the rest once this one exits."""
    if not _active():
        return
    import gc

    import torch.distributed as dist

    # DDP's hooks keep the trained model, its reducer and the process group in reference cycles: free them
    # now, not during interpreter shutdown, where gloo's threads can abort the process (SIGABRT).
    gc.collect()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
