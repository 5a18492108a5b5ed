"""Resume a killed distill run by running the same command again.

Every distill run writes ``resume_key.json`` before training: a hash of what
decides the training trajectory (the generated data, the target, the drafter
and the distill settings except ``max_steps``, ``checkpoint_every`` and
``resume``). With ``distill.resume=auto`` a new run looks under ``outputs``
for the newest *unfinished* distill run (no ``COMPLETE``) with the same key
and a complete ``checkpoint-<step>``, takes over its ``checkpoints/`` folder
(moved, not copied: the old run is dead) and continues from the last
checkpoint with the same optimizer state and data order
(``distill.training.loop.train_drafter(resume_from=...)``). The new run's ``log.jsonl``
starts with the old run's records up to that checkpoint, and the rest of the old
run folder (config, logs) moves to ``<new run>/attempts/<old name>``, so no dead
folder is left among the runs. A pipeline run again after its distill stage finished reuses that
finished run (:func:`find_finished`). ``distill.resume=<run or checkpoint folder>`` leaves
that folder where it is (it may be a finished run) and copies its curves
(``metrics.jsonl``, ``validation.jsonl``, ``log.jsonl``) up to the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import IO

from distill import files
from distill.config import Config
from distill.errors import ConfigError
from distill.files import write_json_atomic
from distill.hardware import resolve_mixed_precision
from distill.runs import COMPLETE, run_damage
from distill.training.checkpoint import STATE_FILE, complete_checkpoints
from distill.training.loop import METRICS_FILE, VALIDATION_FILE

log = logging.getLogger(__name__)
RESUME_KEY = "resume_key.json"
LOCK = ".distill.lock"  # held while a run trains: a live run's checkpoints are never taken over
CHECKPOINTS = "checkpoints"
ATTEMPTS = "attempts"  # earlier, killed runs that this one continued
LOG = "log.jsonl"  # distill.tracking.JsonlLogger's file
_NOT_IN_KEY = ("max_steps", "checkpoint_every", "checkpoint_at", "resume", "keep_checkpoints", "validate_every")


def _unused_settings(distill: dict) -> set[str]:
    """Distill settings that the others make moot (``jsd_beta`` with ``loss=fkl``): left out of the key, so
    that writing one of them does not retrain a finished run."""
    unused = set()
    if distill["loss"] != "jsd":
        unused.add("jsd_beta")
    if distill["method"] not in ("lora", "qlora"):
        unused |= {"lora_r", "lora_alpha", "lora_dropout"}
    if distill["method"] != "full":
        unused.add("freeze_embeddings")
    if not distill["on_policy_fraction"]:
        unused.add("on_policy_temperature")
    if distill.get("lr_schedule", "linear") == "linear":  # the schedule of every run before the setting existed
        unused.add("lr_schedule")
    return unused


def resume_key(cfg: Config, data_identity: str, target_fingerprint: str) -> str:
    """Hash of everything that decides the training trajectory (see the module docstring); settings that
    the others make moot (``jsd_beta`` unless ``loss=jsd``, the LoRA ones with ``method=full``) are left out."""
    distill = asdict(cfg.distill)
    distill = {k: v for k, v in distill.items() if k not in _NOT_IN_KEY and k not in _unused_settings(distill)}
    # fsdp keys apart (its checkpoints resume only under fsdp); ddp, the default, leaves the key as without the setting
    if distill["parallel"] == "ddp":
        del distill["parallel"]
    if distill["packing"] is False:  # likewise: runs made before the setting existed keep their key
        del distill["packing"]
    # what "auto" becomes here: the same command trains in bf16 on one machine and in float32 on another
    distill["mixed_precision"] = resolve_mixed_precision(distill["mixed_precision"])
    blob = json.dumps({"data": data_identity, "target": target_fingerprint, "drafter": asdict(cfg.drafter),
                       "distill": distill}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _damage(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be loaded (a truncated or unreadable file), or None. Cheap: it reads the
    safetensors headers and the zip directories of the torch files, not the tensors."""
    import zipfile

    from safetensors import safe_open

    for path in sorted(checkpoint.iterdir()):
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt"):
                    pass
            elif path.suffix == ".pt":
                with zipfile.ZipFile(path):
                    pass
            elif path.name == STATE_FILE:
                json.loads(path.read_text())
        except Exception as err:  # noqa: BLE001 (any failure to read means: not this checkpoint)
            return f"{path.name}: {type(err).__name__}: {str(err)[:120]}"
    return None


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The ``checkpoint-<step>`` folder with the highest step that holds its state file and whose files can
    be read, or None. A damaged one (a disk fault, a power cut) is skipped with a warning: the previous one is
    used instead of failing every later run of the same command."""
    for _, path in reversed(complete_checkpoints(checkpoints)):
        damage = _damage(path)
        if damage is None:
            return path
        log.warning("%s cannot be read (%s): skipping it; an earlier checkpoint is used if there is one", path, damage)
    return None


def hold_lock(run_dir: Path) -> IO[str]:
    """Lock ``run_dir`` as training (:func:`distill.files.hold_lock` on its ``.distill.lock``).

    Raises:
        BlockingIOError: another live process trains in ``run_dir``.
    """
    return files.hold_lock(Path(run_dir) / LOCK)


def find_resumable(outputs: Path, key: str, exclude: Path) -> tuple[Path, Path] | None:
    """The newest unfinished distill run under ``outputs`` with ``key`` and a checkpoint: ``(run dir, checkpoint)``."""
    candidates = []
    for marker in Path(outputs).glob(f"**/{RESUME_KEY}"):
        run = marker.parent
        if run.resolve() == Path(exclude).resolve() or (run / COMPLETE).exists() or files.is_locked(run / LOCK):
            continue
        try:
            if json.loads(marker.read_text())["key"] != key:
                continue
        except (OSError, ValueError, KeyError):
            continue
        checkpoint = latest_checkpoint(run / CHECKPOINTS)
        if checkpoint is not None:
            candidates.append((marker.stat().st_mtime, run, checkpoint))
    if not candidates:
        return None
    _, run, checkpoint = max(candidates)
    return run, checkpoint


def find_finished(outputs: Path, key: str, max_steps: int) -> Path | None:
    """The newest *finished* distill run under ``outputs`` with ``key`` that trained ``max_steps`` steps: what
    training again with the same data and settings would reproduce (a pipeline re-run reuses it)."""
    candidates = []
    for marker in Path(outputs).glob(f"**/{RESUME_KEY}"):
        run = marker.parent
        if not (run / COMPLETE).exists():
            continue
        try:
            same = json.loads(marker.read_text())["key"] == key
            steps = json.loads((run / "manifest.json").read_text())["train"]["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if same and steps == max_steps:
            if damage := run_damage(run, json.loads((run / "manifest.json").read_text())):
                log.warning("not reusing the finished run %s: %s; training again", run, damage)
                continue
            candidates.append((marker.stat().st_mtime, run))
    return max(candidates)[1] if candidates else None


def named_checkpoint(mode: str) -> Path | None:
    """The checkpoint that ``distill.resume=<folder>`` names; None for ``auto`` and ``never``.

    Called before data and models load as well, so a wrong folder is refused in seconds.

    Raises:
        ConfigError: the folder is neither a complete ``checkpoint-<step>`` nor a distill run with one, or the
            checkpoint it names has a file that cannot be read (named, with the readable checkpoint before it).
    """
    if mode in ("auto", "never"):
        return None
    path = Path(mode)
    checkpoint = path if (path / STATE_FILE).is_file() else latest_checkpoint(path / CHECKPOINTS)
    if checkpoint is None:
        hint = (" (distill.resume=auto continues the newest unfinished run of the same settings)"
                if mode.lower() in ("true", "yes", "on", "1") else "")
        raise ConfigError(f"distill.resume={mode}: not a checkpoint-<step> folder nor a distill run with "
                          f"checkpoints; use auto, never, or a folder holding {STATE_FILE}{hint}")
    if checkpoint == path and (damage := _damage(path)):  # named by the user: never swapped for another
        found = complete_checkpoints(path.parent)
        step = next((step for step, p in found if p.name == path.name), None)
        earlier = [p for n, p in found if step is not None and n < step and _damage(p) is None]
        instead = f"name an earlier one (distill.resume={earlier[-1]})" if earlier else "use distill.resume=never"
        raise ConfigError(f"distill.resume={mode}: the checkpoint cannot be read ({damage}; cut short or changed "
                          f"since it was written): {instead}")
    return checkpoint


def prepare_resume(cfg: Config, run_dir: Path, key: str) -> tuple[Path | None, dict]:
    """Record ``key`` in ``run_dir`` and pick the checkpoint to resume from, per ``distill.resume``.

    Returns:
        ``(checkpoint or None, facts for the manifest)``. With ``auto`` a found run's
        ``checkpoints/`` folder is moved into ``run_dir``.

    Raises:
        ConfigError: ``distill.resume`` names a folder that is not a complete checkpoint.
    """
    run_dir = Path(run_dir)
    write_json_atomic(run_dir / RESUME_KEY, {"key": key})  # the caller holds hold_lock(run_dir) while training
    mode = cfg.distill.resume
    if mode == "never":
        return None, {}
    if mode != "auto":
        checkpoint = named_checkpoint(mode)
        _copy_history(checkpoint, run_dir)
        return checkpoint, {"resumed_from": str(checkpoint)}
    found = find_resumable(Path(cfg.outputs), key, run_dir)
    if found is None:
        return None, {}
    old_run, checkpoint = found
    target = run_dir / CHECKPOINTS
    if target.exists() and not any(target.iterdir()):
        target.rmdir()
    os.replace(old_run / CHECKPOINTS, target)  # same file system: a rename
    step = int(checkpoint.name.split("-", 1)[1])
    _continue_log(old_run / LOG, run_dir / LOG, step)
    kept = run_dir / ATTEMPTS / old_run.name
    try:
        kept.parent.mkdir(exist_ok=True)
        os.replace(old_run, kept)
    except OSError:  # another file system: leave it where it was, emptied of its checkpoints
        kept = old_run
    print(f"distill: resuming {old_run} from {checkpoint.name} (its checkpoints moved to {target}, "
          f"the rest of it to {kept})")
    return target / checkpoint.name, {"resumed_from": str(target / checkpoint.name), "resumed_run": str(kept)}


def _copy_history(checkpoint: Path, run_dir: Path) -> None:
    """Start ``run_dir``'s curves with those of the run that wrote ``checkpoint`` (``distill.resume=<folder>``).

    The named run is left as it was (it may be finished and still in use), so its per-step and
    validation records and its log are copied, not moved; training keeps those up to the
    checkpoint's step (``distill.training.loop._keep_steps_up_to``), so the new run holds the whole curve.
    """
    old_checkpoints, new_checkpoints = checkpoint.parent, run_dir / CHECKPOINTS
    step = checkpoint.name.partition("-")[2]
    if old_checkpoints.resolve() == new_checkpoints.resolve() or not step.isdigit():
        return  # the same run, or a renamed checkpoint folder whose step the name does not tell
    new_checkpoints.mkdir(parents=True, exist_ok=True)
    for name in (METRICS_FILE, VALIDATION_FILE):
        if (old_checkpoints / name).is_file() and not (new_checkpoints / name).exists():
            shutil.copyfile(old_checkpoints / name, new_checkpoints / name)
    _continue_log(old_checkpoints.parent / LOG, run_dir / LOG, int(step))


def _continue_log(old: Path, new: Path, step: int) -> None:
    """Start ``new`` with the step records of ``old`` up to ``step`` (those after it are redone)."""
    if not old.is_file():
        return
    kept = []
    for line in old.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        if isinstance(record.get("step"), int) and record["step"] <= step and "summary" not in record:
            kept.append(line + "\n")
    with new.open("a", encoding="utf-8") as handle:
        handle.writelines(kept)
