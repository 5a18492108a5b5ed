"""File writes that never leave half a file: atomic files and folders, free-space checks, shareable modes, locks.

Every stage writes through these, so a killed or full-disk run leaves either the old file or the new one,
never a cut one, with the modes a plain write would give.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from distill.errors import ConcurrentWriteError, DiskFullError


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def make_shareable(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes a plain write would: ``mkstemp``
    and ``mkdtemp`` create 0600/0700, and safetensors writes 0600, so an atomically written export would
    otherwise be unreadable to other users (a serving account, a container)."""
    path, umask = Path(path), _umask()
    if path.is_file():
        path.chmod(0o666 & ~umask)
        return
    path.chmod(0o777 & ~umask)
    for child in path.rglob("*"):
        child.chmod((0o777 if child.is_dir() else 0o666) & ~umask)


def human_bytes(count: float) -> str:
    """``count`` bytes in the unit that fits: ``512 bytes``, ``3.4 KiB``, ``12.0 MiB``, ``2.31 GiB``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}" if unit == "GiB" else f"{count / size:.1f} {unit}"
    return f"{int(count)} bytes"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (never half-written).

    Raises:
        DiskFullError: the disk filled up; the temporary file is removed and ``path`` is as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        make_shareable(Path(tmp))
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(err, path, len(data)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_free_space(path: Path, needed_bytes: int, what: str) -> None:
    """Refuse before writing ``what`` (about ``needed_bytes``) to ``path`` if its file system has less free.

    Raises:
        DiskFullError: naming the path, the free and the needed bytes.
    """
    free = shutil.disk_usage(_existing_parent(path)).free
    if free < needed_bytes:
        raise DiskFullError(f"not enough disk space for {what} at {path}: about {human_bytes(needed_bytes)} "
                            f"needed, {human_bytes(free)} free; free some space or point outputs= "
                            f"(or export.path=) to another disk")


def _disk_full(err: OSError, path: Path, needed_bytes: int | None) -> DiskFullError:
    free = shutil.disk_usage(_existing_parent(path)).free
    need = f"about {human_bytes(needed_bytes)} needed, " if needed_bytes else ""
    return DiskFullError(f"the disk filled up while writing {path} ({need}{human_bytes(free)} free now; the "
                         f"partial output was removed); free some space or point outputs= to another disk and run "
                         f"the same command again")


@contextmanager
def atomic_dir(final: Path, needed_bytes: int | None = None, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder, renamed to ``final`` when the block ends without error.

    Args:
        needed_bytes: the expected size of what goes in; checked against the free space first.
        replace: an existing folder ``final`` (not a link: the caller resolves links first) is swapped out for
            the new one only once the new one is whole, then deleted; on any failure it is left as it was.

    Raises:
        FileExistsError: ``final`` already exists and ``replace`` is false (the caller decides about
            overwriting first).
        DiskFullError: too little free space before, or the disk filled up while writing.
        ConcurrentWriteError: another process renamed a folder to ``final`` first.
    """
    final = Path(final)
    if final.exists() and not (replace and final.is_dir() and not final.is_symlink()):
        raise FileExistsError(f"{final} already exists")
    if needed_bytes:
        require_free_space(final.parent, needed_bytes, final.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        yield tmp
        make_shareable(tmp)
        if replace:
            _publish(tmp, final)
        else:  # fails when another process renamed a folder to ``final`` meanwhile: theirs is kept
            os.replace(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_full(err, final, needed_bytes) from err
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ConcurrentWriteError(f"{final} was written by another process while this one wrote it: two "
                                       f"runs share outputs= and wrote the same folder. The other's copy was "
                                       f"kept; run the same command again once it has finished") from err
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``; an existing ``final`` is moved aside first, put back if
    the rename fails, and deleted only once the new folder is in place."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".old"))
    os.replace(final, old)  # a rename onto an empty folder: the old folder now lives at ``old``
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def hold_lock(path: Path) -> IO[str]:
    """Take an exclusive lock on the file ``path`` (created if missing) and return its open handle.

    The lock lasts while the handle is open and is released when the process dies, however it dies, so a
    lock never outlives its owner.

    Raises:
        BlockingIOError: another process holds it.
    """
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        handle.close()
        raise
    return handle


def is_locked(path: Path) -> bool:
    """Whether another process holds :func:`hold_lock` on ``path`` (False when the file cannot be opened)."""
    try:
        hold_lock(path).close()
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@contextmanager
def exclusive(folder: Path, waiting: str) -> Iterator[None]:
    """Hold :func:`hold_lock` on ``folder/.lock`` for the block; when another process holds it, print
    ``waiting`` and wait. Two runs that write the same shard cache then take turns, and the second reuses
    what the first finished instead of writing the same shards."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        handle = hold_lock(folder / ".lock")
    except BlockingIOError:
        print(waiting, flush=True)
        handle = open(folder / ".lock", "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
    with handle:
        yield
