"""Run folders: manifests, completion markers, damage checks, finding a stage's input run.

Every stage writes one folder holding ``config.yaml``, ``manifest.json`` and its
outputs, and writes ``COMPLETE`` last. A later stage reads only folders that
carry the marker, so a killed run is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import platform
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from distill.errors import DamagedRunError, IncompleteRunError
from distill.files import human_bytes, write_json_atomic, write_text_atomic
from distill.hardware import hardware

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
_VERSIONED = ("torch", "transformers", "datasets", "peft", "accelerate", "hydra-core", "draftsmith")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


@dataclass
class StageRun:
    """A stage's run folder and its manifest, finished by :meth:`complete`."""

    stage: str
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, stage: str, path: Path, config_yaml: str, inputs: dict[str, str] | None = None) -> "StageRun":
        """Create (or reopen, for resume) ``path`` and record the resolved config."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / COMPLETE).unlink(missing_ok=True)
        write_text_atomic(path / "config.yaml", config_yaml)
        manifest = {"stage": stage, "inputs": inputs or {}, "versions": package_versions(), "hardware": hardware(),
                    "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        return cls(stage=stage, path=path, manifest=manifest)

    def complete(self, artifacts: Sequence[str] = (), **extra: Any) -> Path:
        """Write the manifest with wall time, peak memory and the sizes of the files in ``artifacts`` (file or
        folder names in the run folder: what later stages load, checked by :func:`require_complete`), then the
        completion marker."""
        self.manifest.update(extra)
        self.manifest[FILE_SIZES] = artifact_sizes(self.path, artifacts)
        self.manifest["wall_s"] = round(time.perf_counter() - self.started, 2)
        self.manifest["peak_rss_bytes"] = peak_rss_bytes()
        self.manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_json_atomic(self.path / MANIFEST, self.manifest)
        write_text_atomic(self.path / COMPLETE, self.manifest["finished_at"] + "\n")
        return self.path


FILE_SIZES = "file_sizes"  # in a manifest: {path relative to the run folder: bytes} of what the run wrote


def artifact_sizes(run: Path, names: Sequence[str]) -> dict[str, int]:
    """``{relative path: bytes}`` of every file in ``run``'s files or folders ``names`` (missing ones skipped)."""
    sizes = {}
    for name in names:
        item = Path(run) / name
        files = [item] if item.is_file() else sorted(f for f in item.rglob("*") if f.is_file())
        sizes.update({str(f.relative_to(run)): f.stat().st_size for f in files})
    return sizes


def record_rewritten(run: Path, names: Sequence[str]) -> None:
    """After the files ``names`` of the finished run ``run`` were rewritten on purpose (the pipeline adds its
    stages' figures to evaluate's report.json), record their new sizes, so :func:`run_damage` does not take
    them for damage."""
    manifest = read_manifest(run)
    manifest[FILE_SIZES] = {**manifest.get(FILE_SIZES, {}), **artifact_sizes(run, names)}
    write_json_atomic(Path(run) / MANIFEST, manifest)


def run_damage(run: Path, manifest: dict[str, Any]) -> str | None:
    """What is wrong with a finished run's files against the sizes its manifest recorded, or None. A size
    check is cheap (no reading) and catches what a full disk, a killed copy or a sync leaves: a cut file."""
    for rel, size in manifest.get(FILE_SIZES, {}).items():
        item = Path(run) / rel
        if not item.is_file():
            return f"{rel} is missing"
        if (found := item.stat().st_size) != size:
            return f"{rel} is {human_bytes(found)} where the run wrote {human_bytes(size)}"
    return None


def rerun_command(run: Path) -> str | None:
    """The command line that made ``run`` (a stage folder, or one inside a pipeline's), from Hydra's
    ``.hydra/overrides.yaml``; None when it is not there."""
    for folder in (Path(run), Path(run).parent):
        overrides = folder / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            try:
                args = [str(a) for a in yaml.safe_load(overrides.read_text()) or []]
            except (OSError, yaml.YAMLError):
                return None
            stage = next((a.split("=", 1)[1] for a in args if a.startswith("stage=")), None)
            rest = [a for a in args if not a.startswith("stage=")]
            return shlex.join(["draftsmith", stage or recorded_stage(run) or "<stage>", *rest])
    return None


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the run folder ``path``.

    Raises:
        DamagedRunError: the manifest is missing, unreadable or not a JSON object (cut short by a full disk or a
            killed copy); the message names the file and the command that writes the run again.
    """
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = "is empty" if file.is_file() and file.stat().st_size == 0 else \
            f"cannot be read ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        raise DamagedRunError(_damaged(Path(path), f"{MANIFEST} {problem}")) from err
    if not isinstance(manifest, dict):
        raise DamagedRunError(_damaged(Path(path), f"{MANIFEST} is not a JSON object"))
    return manifest


def _damaged(run: Path, damage: str, stage: str = "", key: str | None = None) -> str:
    """The one line that names a damaged finished run, what is wrong and the command that writes it again
    (and ``key``, the setting that picks another run, when there is one)."""
    command = rerun_command(run)
    again = f"`{command}` (the command that made it)" if command else \
        f"the command that made it (its settings are in {run / 'config.yaml'})"
    instead = f", or pass {key}=<another finished {stage} run>" if key else ""
    return (f"the finished {stage + ' ' if stage else ''}run {run} is damaged: {damage} (cut short or changed since "
            f"it finished). Run {again} again: it writes a new run, reusing what is intact{instead}")


REUSED = "reused.json"  # in a sweep's job folder: {"<stage>_run": the finished run that the job returned}


def require_complete(path: str | Path, stage: str, key: str | None = None) -> Path:
    """Check that ``path`` is a finished run folder of ``stage``; ``key`` names the config key in errors
    (default ``inputs.<stage>``).

    Raises:
        IncompleteRunError: the folder is missing, unfinished, or from another stage.
        DamagedRunError: a file the run wrote is missing or not the size it had (the message gives the
            command that writes the run again).
    """
    path, key = Path(path).expanduser().absolute(), key or f"inputs.{stage}"  # recorded in manifests: absolute
    if (path / REUSED).is_file():  # a sweep job that found its run already finished: that run
        path = Path(json.loads((path / REUSED).read_text())[f"{stage}_run"])
    if not path.is_dir():
        raise IncompleteRunError(f"{stage} run folder {path} does not exist: pass {key}=<folder of a finished {stage} run>")
    if not (path / MANIFEST).is_file() and (path / stage / MANIFEST).is_file():  # a pipeline's folder
        raise IncompleteRunError(f"{path} is a pipeline run, which holds one folder per stage: "
                                 f"pass {key}={path / stage}")
    if not any((path / name).is_file() for name in (MANIFEST, "config.yaml")):  # StageRun.start wrote neither:
        # a sweep folder, a drafter/ folder, ...: not a run at all
        raise IncompleteRunError(f"{path} is not a {stage} run folder: pass "
                                 f"{key}=<a finished {stage} run folder>, e.g. outputs/{stage}/<date>_<time>; "
                                 f"quote a sweep job's folder for the shell and Hydra: \"{key}='<folder>'\"")
    if not is_complete(path):
        raise IncompleteRunError(
            f"{path} has no {COMPLETE} marker: that {stage} run did not finish. Re-run it with the same "
            f"command (it resumes), or pass {key}=<a finished run folder>")
    try:
        manifest = read_manifest(path)
    except DamagedRunError as err:
        raise DamagedRunError(f"{err}, or pass {key}=<another finished {stage} run>") from err
    found = manifest.get("stage")
    if found != stage:
        raise IncompleteRunError(f"{path} is a run of stage {found!r}, not {stage!r}: pass {key}=<a {stage} run folder>")
    if damage := run_damage(path, manifest):
        raise DamagedRunError(_damaged(path, damage, stage, key))
    return path


def recorded_stage(run: Path) -> str | None:
    """The stage that wrote ``run``, from its manifest or, when that cannot be read, its ``config.yaml`` (a
    pipeline names each stage's folder after the stage); None when neither says."""
    for read in (lambda: json.loads((run / MANIFEST).read_text())["stage"],
                 lambda: yaml.safe_load((run / "config.yaml").read_text())["stage"]):
        try:
            stage = read()
        except Exception:  # noqa: BLE001 (unreadable, cut, not a mapping: this source does not say)
            continue
        return run.name if stage == "pipeline" else str(stage)
    return None


def find_latest(outputs: str | Path, stage: str, where: Callable[[dict], bool] | None = None) -> Path:
    """The newest finished run folder of ``stage`` under ``outputs`` (pipeline sub-folders included) whose
    manifest passes ``where`` (if given).

    Raises:
        IncompleteRunError: there is none.
        DamagedRunError: the newest finished run of ``stage`` has a manifest that cannot be read (it may be the
            one wanted, so an older run is never taken in its place without a word).
    """
    candidates, damaged = [], []
    for marker in Path(outputs).glob(f"**/{COMPLETE}"):
        folder = marker.parent
        try:
            manifest = read_manifest(folder)
        except DamagedRunError as err:
            if recorded_stage(folder) == stage:  # neither manifest nor config.yaml says: not a run folder
                damaged.append((folder, err))
            continue
        if manifest.get("stage") == stage and (where is None or where(manifest)):
            candidates.append(folder)
    newest = max([*candidates, *(f for f, _ in damaged)], key=lambda p: (p / COMPLETE).stat().st_mtime, default=None)
    if newest is None:
        raise IncompleteRunError(
            f"no finished {stage} run under {outputs}/: run `draftsmith {stage}` first or pass inputs.{stage}=<folder>")
    if newest not in candidates:
        older = max(candidates, key=lambda p: (p / COMPLETE).stat().st_mtime, default=None)
        fallback = f" (the newest intact one is {older})" if older else ""
        raise DamagedRunError(f"{dict(damaged)[newest]}; it is the newest {stage} run under {outputs}/, so no older "
                              f"one is taken in its place: pass inputs.{stage}=<a finished {stage} run>{fallback}")
    return newest


def resolve_input(given: str | None, outputs: str | Path, stage: str) -> Path:
    """``given`` checked as a finished ``stage`` run, or the newest one under ``outputs``."""
    return require_complete(given or find_latest(outputs, stage), stage)
