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

import torch
from transformers import AutoTokenizer

from distill.config import Config
from distill.errors import ConfigError
from distill.evaluate import REPORT_JSON, REPORT_MD, run_evaluate
from distill.export import EXPORT_DIR, check_export_destination, run_export
from distill.generate import run_generate
from distill.models import resolve_model
from distill.prompts import load_prompts
from distill.report import write_report_markdown
from distill.resume import named_checkpoint
from distill.rundir import read_manifest, write_json_atomic
from distill.train_stage import check_layers_exist, check_qlora, check_tokenizers, run_distill
from distill.training_data import resolve_extra_generate


def _release_memory() -> None:
    """Give the previous stage's model memory back to the OS before the next stage loads its models."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def preflight(cfg: Config, export_run: Path) -> None:
    """Checks that would otherwise fail a later stage after the earlier ones did their work.

    Raises:
        ConfigError: fp16 training or QLoRA without CUDA; stored target log-probs that generate
            would not store; an ``inputs.extra_generate`` run of another target or without them; a
            ``distill.resume`` folder without a checkpoint.
        IncompleteRunError: an ``inputs.extra_generate`` folder is not a finished generate run.
        PromptError: the ``evaluate.prompts`` file is missing, empty or malformed.
        DraftsmithError: the export destination is taken.
        TokenizerMismatchError: target and drafter cannot share tokens (tokenizers only, no weights loaded).
    """
    if cfg.distill.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("distill.mixed_precision=fp16 needs CUDA; on CPU use distill.mixed_precision=bf16 or no")
    if cfg.distill.target_source == "stored" and cfg.generate.store_top_k == 0:
        raise ConfigError("distill.target_source=stored trains on the target's stored top-k log-probs: "
                          "add generate.store_top_k=20")
    check_qlora(cfg)
    check_export_destination(Path(cfg.export.path) if cfg.export.path else export_run / EXPORT_DIR,
                             cfg.export.overwrite)
    target = AutoTokenizer.from_pretrained(resolve_model(cfg.target.name).path)
    drafter = AutoTokenizer.from_pretrained(resolve_model(cfg.drafter.name).path)
    check_tokenizers(target, drafter, cfg.target.name, cfg.drafter.name)
    check_layers_exist(cfg)
    resolve_extra_generate(cfg)  # inputs.extra_generate: finished, same target, stored top-k where needed
    named_checkpoint(cfg.distill.resume)  # distill.resume=<folder>: a checkpoint is there
    if cfg.evaluate.prompts:  # evaluate.prompts=<file>: readable and well formed
        load_prompts("file", str(cfg.evaluate.prompts), limit=cfg.evaluate.num_prompts, key="evaluate.prompts")
    for name in cfg.evaluate.compare_drafters:  # evaluate.compare_drafters: resolvable, same tokens
        other = AutoTokenizer.from_pretrained(resolve_model(name).path)
        check_tokenizers(target, other, cfg.target.name, name)
    size = cfg.drafter.draft_vocab_size
    if size is not None and not 2 <= size <= len(drafter):
        raise ConfigError(f"drafter.draft_vocab_size={size} must be between 2 and the drafter's {len(drafter)} "
                          "tokens (e.g. 32000 for Qwen), or null for the full vocabulary")
    if cfg.generate.store_top_k > len(target):
        raise ConfigError(f"generate.store_top_k={cfg.generate.store_top_k} is more than the target's "
                          f"{len(target)} tokens: use at most {len(target)} (20 is plenty)")


def run_pipeline(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run the four stages under ``run_dir``; returns the path of the final ``report.json``."""
    run_dir = Path(run_dir)
    folders = {name: run_dir / name for name in ("generate", "distill", "evaluate", "export")}
    inputs = dataclasses.replace(cfg.inputs, generate=str(folders["generate"]), distill=str(folders["distill"]),
                                 evaluate=str(folders["evaluate"]))
    staged = dataclasses.replace(cfg, inputs=inputs)
    preflight(staged, folders["export"])

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
