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


class TokenizerMismatchError(DraftsmithError):
    """Target and drafter tokenizers differ, so draft tokens cannot be verified."""


class DiskFullError(DraftsmithError):
    """Not enough disk space for an output; the message names the path, the free and the needed bytes."""
