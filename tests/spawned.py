"""Tests that train in several processes on one machine: a free port and the ranks' recordings."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_and_collect(worker: Callable, out: Path, nprocs: int) -> list[Any]:
    """Run ``worker(rank, port, str(out))`` in ``nprocs`` processes and return what each saved to
    ``out / f"rank{rank}.pt"``, in rank order."""
    import torch
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(free_port(), str(out)), nprocs=nprocs, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
