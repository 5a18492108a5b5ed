"""``draftsmith pipeline``: generate -> distill -> evaluate -> export in one run folder.

Each stage gets its own sub-folder and reads the previous one explicitly, so a
pipeline never picks up another run's output. The final ``report.json`` gains
the wall time and peak memory of every stage.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
from pathlib import Path

from distill.config import Config
from distill.evaluate import REPORT_JSON, REPORT_MD, run_evaluate
from distill.export import run_export
from distill.generate import run_generate
from distill.report import write_report_markdown
from distill.rundir import read_manifest, write_json_atomic
from distill.train_stage import run_distill


def _release_memory() -> None:
    """Give the previous stage's model memory back to the OS before the next stage loads its models."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def run_pipeline(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run the four stages under ``run_dir``; returns the path of the final ``report.json``."""
    run_dir = Path(run_dir)
    folders = {name: run_dir / name for name in ("generate", "distill", "evaluate", "export")}
    inputs = dataclasses.replace(cfg.inputs, generate=str(folders["generate"]), distill=str(folders["distill"]),
                                 evaluate=str(folders["evaluate"]))
    staged = dataclasses.replace(cfg, inputs=inputs)

    print(f"[1/4] generate -> {folders['generate']}")
    run_generate(staged, folders["generate"], config_yaml)
    _release_memory()
    print(f"[2/4] distill -> {folders['distill']}")
    run_distill(staged, folders["distill"], config_yaml)
    _release_memory()
    print(f"[3/4] evaluate -> {folders['evaluate']}")
    report_path = run_evaluate(staged, folders["evaluate"], config_yaml)
    print(f"[4/4] export -> {folders['export']}")
    exported = run_export(staged, folders["export"], config_yaml)

    report = json.loads(report_path.read_text())
    report["stages"] = {name: {k: read_manifest(folder).get(k) for k in ("wall_s", "peak_rss_bytes")}
                        for name, folder in folders.items()}
    report["export"] = str(exported)
    write_json_atomic(report_path, report)
    write_report_markdown(report, report_path.with_name(REPORT_MD))
    print((report_path.with_name(REPORT_MD)).read_text())
    return report_path
