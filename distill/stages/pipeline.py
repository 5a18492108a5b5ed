"""``draftsmith pipeline``: generate -> distill -> evaluate -> export in one run folder.

Each stage gets its own sub-folder and reads the previous one explicitly, so a
pipeline never picks up another run's output. The final ``report.json`` gains
the wall time and peak memory of every stage.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from transformers import AutoTokenizer

from distill.config import Config
from distill.data.prompts import load_prompts
from distill.data.training_data import resolve_extra_generate
from distill.drafters.setup import check_drafter_tokens, check_layers_exist, check_tokenizers, check_training_hardware
from distill.errors import ConfigError
from distill.files import write_json_atomic
from distill.hardware import release_memory
from distill.measure.report import REPORT_MD, write_report_markdown
from distill.models.loading import resolve_model
from distill.runs import read_manifest, record_rewritten, require_complete
from distill.stages.distill import run_distill
from distill.stages.evaluate import run_evaluate
from distill.stages.export import check_export_destination, export_destination, run_export
from distill.stages.generate import run_generate
from distill.training.resume import named_checkpoint


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
    if cfg.distill.target_source == "stored" and cfg.generate.store_top_k == 0:
        raise ConfigError("distill.target_source=stored trains on the target's stored top-k log-probs: "
                          "add generate.store_top_k=20")
    check_training_hardware(cfg)
    check_export_destination(export_destination(cfg.export.path, export_run), cfg.export.overwrite, export_run)
    target = AutoTokenizer.from_pretrained(resolve_model(cfg.target.name).path)
    check_drafter_tokens(cfg, target)  # same tokens; drafter.draft_vocab_size fits
    check_layers_exist(cfg)
    resolve_extra_generate(cfg)  # inputs.extra_generate: finished, same target, stored top-k where needed
    named_checkpoint(cfg.distill.resume)  # distill.resume=<folder>: a checkpoint is there
    if cfg.evaluate.prompts:  # evaluate.prompts=<file>: readable and well formed
        load_prompts("file", str(cfg.evaluate.prompts), limit=cfg.evaluate.num_prompts, key="evaluate.prompts")
    for name in cfg.evaluate.compare_drafters:  # evaluate.compare_drafters: resolvable, same tokens
        other = AutoTokenizer.from_pretrained(resolve_model(name).path)
        check_tokenizers(target, other, cfg.target.name, name)
    if cfg.generate.store_top_k > len(target):
        raise ConfigError(f"generate.store_top_k={cfg.generate.store_top_k} is more than the target's "
                          f"{len(target)} tokens: use at most {len(target)} (20 is plenty)")


def given_runs(cfg: Config) -> dict[str, Path]:
    """Finished runs the user handed the pipeline (``inputs.generate``, ``inputs.distill``): their stages are
    not run again. A given distill run brings the generate run it was trained on (for the held-out prompts)
    unless ``inputs.generate`` names another.

    Raises:
        IncompleteRunError: a given folder is missing, unfinished or of another stage.
        ConfigError: ``inputs.evaluate`` is set (the pipeline evaluates what it trained).
    """
    if cfg.inputs.evaluate:
        raise ConfigError("the pipeline evaluates the drafter it trains, so inputs.evaluate has no use here: drop it "
                          "(draftsmith export inputs.evaluate=<run> exports with another run's figures)")
    given = {stage: require_complete(folder, stage) for stage in ("generate", "distill")
             if (folder := getattr(cfg.inputs, stage))}
    if "distill" in given and "generate" not in given:
        given["generate"] = require_complete(read_manifest(given["distill"])["inputs"]["generate"], "generate",
                                             key=f"the generate run of {given['distill']}")
    return given


def run_pipeline(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run the four stages under ``run_dir``; returns the path of the final ``report.json``.

    A stage whose finished run is given (``inputs.generate``, ``inputs.distill``; see ``given_runs``) is
    skipped and that run is read instead.
    """
    run_dir = Path(run_dir)
    given = given_runs(cfg)
    folders = {name: given.get(name, run_dir / name) for name in ("generate", "distill", "evaluate", "export")}
    inputs = dataclasses.replace(cfg.inputs, generate=str(folders["generate"]), distill=str(folders["distill"]),
                                 evaluate=str(folders["evaluate"]))
    staged = dataclasses.replace(cfg, inputs=inputs)
    preflight(staged, folders["export"])

    if "generate" in given:
        print(f"[1/4] generate: using {folders['generate']} (inputs.generate"
              f"{'' if cfg.inputs.generate else ' of the given distill run'}), not generating again")
    else:
        print(f"[1/4] generate -> {folders['generate']}")
        run_generate(staged, folders["generate"], config_yaml)
        release_memory()
    if "distill" in given:
        print(f"[2/4] distill: using {folders['distill']} (inputs.distill), not training")
    else:
        print(f"[2/4] distill -> {folders['distill']}")
        # a re-run after a later stage failed gets the finished run back (distill.resume=auto): no retraining
        trained = run_distill(staged, folders["distill"], config_yaml)
        if trained != folders["distill"]:
            folders["distill"] = trained
            staged = dataclasses.replace(staged, inputs=dataclasses.replace(staged.inputs, distill=str(trained)))
        release_memory()
    print(f"[3/4] evaluate -> {folders['evaluate']}")
    report_path = run_evaluate(staged, folders["evaluate"], config_yaml)
    print(f"[4/4] export -> {folders['export']}")
    exported = run_export(staged, folders["export"], config_yaml)

    report = json.loads(report_path.read_text())
    report["stages"] = {name: {**{k: read_manifest(folder).get(k) for k in ("wall_s", "peak_rss_bytes")},
                               **({"given": str(folder)} if name in given else {}),
                               # not given, yet elsewhere: a finished run returned instead of training again
                               **({"reused": str(folder)} if name not in given and folder != run_dir / name else {})}
                        for name, folder in folders.items()}
    report["export"] = str(exported)
    write_json_atomic(report_path, report)
    record_rewritten(folders["evaluate"], [report_path.name])  # else a later export takes it for a cut file
    write_report_markdown(report, report_path.with_name(REPORT_MD))
    print((report_path.with_name(REPORT_MD)).read_text())
    return report_path
