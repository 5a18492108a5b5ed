"""What the machine can do fast: bf16 hardware units, and what ``auto`` precision settings become here.

The bottom layer of ``distill``: torch only (imported inside the functions, so the CLI starts quickly).
"""

from __future__ import annotations

import os
from typing import Any


def bf16_is_fast(device: str | None = None) -> bool:
    """Whether bfloat16 matrix products have hardware support on ``device`` ("cpu" or "cuda"; None = the
    device training and decoding use: CUDA if present, else the CPU).

    CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). CPU: the AVX512-BF16 or AMX-BF16 units
    (:func:`cpu_bf16_units`). oneDNN also runs bf16 on plain AVX512 (its ``_is_mkldnn_bf16_supported`` says
    True there) but by converting to float32: 3.5x slower than float32 matrix products on an AVX512 Xeon
    without the units, and a scalar fallback many times slower on AVX2 (docs/precision.md).
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    units = cpu_bf16_units()
    if units is not None:
        return bool(units)
    try:  # no CPU flags to read (not Linux): oneDNN's answer, which can say True without the units
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The CPU's bf16 matrix units named in ``cpuinfo``'s flags (``avx512_bf16``, ``amx_bf16``; [] when it has
    none), or None where the file cannot be read (not Linux)."""
    try:
        text = open(cpuinfo, encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def resolve_mixed_precision(setting: str, device: str | None = None) -> str:
    """``distill.mixed_precision`` as accelerate takes it: ``auto`` becomes ``bf16`` where
    :func:`bf16_is_fast` on ``device``, else ``no``; other values are returned as given."""
    if setting != "auto":
        return setting
    return "bf16" if bf16_is_fast(device) else "no"


def auto_dtype() -> str:
    """What ``dtype: auto`` means on this machine: ``bfloat16`` where bf16 matrix products have
    hardware support (:func:`bf16_is_fast` on CUDA if present, else the CPU), else
    ``float32``. Without bf16 units torch runs bf16 through a scalar fallback, several times slower
    than float32 for every stage (docs/precision.md). Float32 also keeps greedy speculative output
    identical to the target's (bf16 verification of K+1 tokens can flip near-ties)."""
    return "bfloat16" if bf16_is_fast() else "float32"


def hardware() -> dict[str, Any]:
    """What a run's speed figures depend on: the CPU's instruction set (torch's ``AVX2``, ``AVX512``, ...),
    its core count, the GPU's name (None without CUDA) and whether bf16 has hardware units there
    (:func:`bf16_is_fast`, which ``dtype: auto`` follows)."""
    import torch

    cuda = torch.cuda.is_available()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "bf16_fast": bf16_is_fast(),
            "cpu_bf16_units": cpu_bf16_units()}


def resolve_auto(config):
    """``config`` with ``target.dtype`` and ``drafter.dtype`` ``auto`` replaced by :func:`auto_dtype`.

    Called once where a run starts (:func:`distill.cli.run_stage`), so every stage, shard key and manifest
    of the run records the dtype it ran in, never ``auto``. Takes and returns a :class:`distill.config.Config`
    (a copy; the argument is left as it is).
    """
    import dataclasses

    def resolved(section):
        return dataclasses.replace(section, dtype=auto_dtype()) if section.dtype == "auto" else section

    return dataclasses.replace(config, target=resolved(config.target), drafter=resolved(config.drafter))


def process_device():
    """Where this process runs the models of generate and evaluate: ``cuda:<LOCAL_RANK>`` where CUDA is
    available (one GPU per process a launcher starts; ``cuda:0`` without a launcher), else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count())
    return torch.device("cpu")


def release_memory() -> None:
    """Give freed model memory back to the OS (a garbage collection, then glibc's ``malloc_trim``; nothing more
    where the C library is not glibc), so that the next models loaded do not stack on freed pages."""
    import ctypes
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
