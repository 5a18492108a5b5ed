"""User-facing errors. Every message says what to change, not only what went wrong."""


class DraftsmithError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ModelNotFoundError(DraftsmithError):
    """A model name/path could not be resolved (missing package, path, or hub access)."""


class ModelIntegrityError(DraftsmithError):
    """Model files exist but are wrong (size or sha256 mismatch, unreadable file)."""


class PromptError(DraftsmithError):
    """A prompt source is missing, empty, or malformed."""


class ConfigError(DraftsmithError):
    """A configuration value is out of range or inconsistent."""


class IncompleteRunError(DraftsmithError):
    """A run folder lacks its COMPLETE marker (the stage crashed or is still running)."""


class DamagedRunError(IncompleteRunError):
    """A finished run's file is missing or not the size the run wrote (cut short or changed since)."""


class TokenizerMismatchError(DraftsmithError):
    """Target and drafter tokenizers differ, so draft tokens cannot be verified."""


class DiskFullError(DraftsmithError):
    """Not enough disk space for an output; the message names the path, the free and the needed bytes."""


class OutOfMemoryError(DraftsmithError):
    """A step ran out of (GPU or host) memory; the message names the step, the size asked for and the settings to lower."""


class ConcurrentWriteError(DraftsmithError):
    """Another process wrote the same output folder at the same time."""


_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")


def out_of_memory_bytes(err: BaseException) -> int | None:
    """If ``err`` is an out-of-memory failure, the bytes the failed allocation asked for (0 if unknown).

    Recognises ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA: "Tried to allocate 2.00 GiB") and
    the CPU allocator's ``RuntimeError`` ("you tried to allocate 123456 bytes").

    Returns:
        bytes (int, 0 when the message does not say) for a memory error; None for any other error.
    """
    import re

    text = str(err)
    if not (isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
            or (isinstance(err, RuntimeError) and any(m in text.lower() for m in _OOM_MARKERS))):
        return None
    if match := re.search(r"allocate ([0-9]+) bytes", text):
        return int(match.group(1))
    if match := re.search(r"allocate ([0-9.]+) ([KMGT]i?B)", text):
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2)[0]]
        return int(float(match.group(1)) * scale)
    return 0
