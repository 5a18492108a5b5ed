"""Stage 4: the tuned drafter in Hugging Face format, for serving stacks.

Writes ``<run>/drafter-hf/`` (or ``export.path``): merged weights (safetensors),
tokenizer, generation config, ``drafter_info.json`` and a model card
(``README.md``) with the measured acceptance and speedup and the exact target it
was tuned for. The folder is written atomically and loaded back with
``AutoModelForCausalLM.from_pretrained`` before the stage reports success.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.config import Config
from distill.drafters.build import describe_layers, state_dict_bytes
from distill.drafters.setup import DRAFTER_DIR, DRAFTER_INFO
from distill.errors import ConfigError, DamagedRunError, DraftsmithError, IncompleteRunError
from distill.files import atomic_dir, write_text_atomic
from distill.measure.report import REPORT_JSON
from distill.measure.timing_trust import disturbed_sentence
from distill.models.gguf import export_gguf
from distill.models.loading import resolve_model
from distill.models.reduced_vocab import DRAFT_VOCAB_FILE
from distill.runs import (MANIFEST, StageRun, find_latest, read_manifest, recorded_stage, require_complete,
                         resolve_input)
from distill.tracking import make_logger, run_name

EXPORT_DIR = "drafter-hf"
GGUF_FILE = "drafter.gguf"


def _report_for(cfg: Config, distill_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The evaluation report of this drafter: ``inputs.evaluate``, else the newest evaluate run that read it."""
    if cfg.inputs.evaluate:
        eval_dir = require_complete(cfg.inputs.evaluate, "evaluate")
        measured = Path(read_manifest(eval_dir)["inputs"].get("distill", ""))
        if measured.resolve() != distill_dir.resolve():
            raise DraftsmithError(f"{eval_dir} measured the drafter of {measured}, not of {distill_dir}: pass the "
                                  "evaluate run of this drafter as inputs.evaluate, or leave it empty")
    else:
        def measured_this(manifest: dict) -> bool:
            return Path(manifest.get("inputs", {}).get("distill", "")).resolve() == distill_dir.resolve()

        try:
            eval_dir = require_complete(find_latest(cfg.outputs, "evaluate", where=measured_this), "evaluate")
        except DamagedRunError:  # the newest evaluate run may be this drafter's: never drop its figures quietly
            raise
        except IncompleteRunError:
            return None, None
    return json.loads((eval_dir / REPORT_JSON).read_text()), eval_dir


def _decoding(decode: dict[str, Any]) -> str:
    temperature = decode.get("temperature", 0.0)
    mode = "greedy" if not temperature else f"sampling at temperature {temperature}, top-p {decode.get('top_p', 1.0)}"
    quantization = decode.get("drafter_quantization_used")
    return f"{mode}, drafter run as {quantization}" if quantization else mode


def _data(info: dict[str, Any]) -> str:
    data = info.get("training_data")  # absent in drafters distilled before it was recorded
    if not data:
        return ""
    runs = data["generate_runs"]
    return (f" ({data['train_examples']:,} training examples from {runs} generate run{'s' if runs > 1 else ''}, "
            f"{data['val_examples']:,} held out for validation)")


def _simulated_card_lines(report: dict) -> list[str]:
    """The exact acceptance on every held-out prompt (evaluate's ``simulated``), when the report has it."""
    sim = report.get("simulated")
    if not sim:
        return []
    base = (report.get("baseline_drafter") or {}).get("simulated") or {}
    lo, hi = sim["ci95"]["mean_accepted_tokens"]
    line = (f"On all {sim['num_prompts']} held-out prompts ({sim['num_tokens']} target tokens), simulated exactly from "
            f"teacher-forced passes: tau {sim['mean_accepted_tokens']:.2f} [95% interval {lo:.2f}, {hi:.2f}]"
            + (f" against {base['mean_accepted_tokens']:.2f} undistilled" if base else ""))
    paired = report.get("paired_difference")
    if paired:
        line += (f"; paired difference {paired['mean_accepted_tokens']:+.3f} "
                 f"[{paired['ci95'][0]:+.3f}, {paired['ci95'][1]:+.3f}]")
    return [line + ". The speedup row times the first few of them.", ""]


def _speed_caveats(report: dict[str, Any]) -> list[str]:
    """Lines that say when the card's speedups are not to be trusted: the machine was busy while measuring,
    or a measured speedup is far from what the cost model (Leviathan et al. 2023, Thm 3.8) predicts."""
    notes = []
    target = report.get("target_tokens_per_s")
    if target:
        notes.append(f"Speedups are the machine's own: the target alone ran at {target:.2f} tokens/s there.")
    warning = disturbed_sentence(report)
    if warning:
        notes.append(warning)
    for who, figures in (("undistilled drafter's", report.get("baseline_drafter") or {}), ("distilled drafter's", report)):
        ratio = figures.get("measured_over_theoretical")
        if ratio is not None and not 0.5 <= ratio <= 2.0:
            notes.append(f"**The {who} speedup is {ratio:.1f}x what the cost model predicts** from its acceptance "
                         "and cost ratio: a noisy measurement, or per-token overhead the model leaves out (it "
                         "weighs most with small models); re-run `draftsmith evaluate` on an idle machine to tell.")
    return notes + ([""] if notes else [])


def model_card(info: dict[str, Any], report: dict[str, Any] | None) -> str:
    """The exported folder's README.md: what the drafter is for and what it measured."""
    lines = [
        "---", "library_name: transformers", "tags: [speculative-decoding, draft-model, draftsmith]", "---", "",
        f"# Draft model for `{info['target_name']}`", "",
        f"A drafter for speculative decoding, initialised from `{info['base_name']}` ({info['init']}"
        + (", " + describe_layers(info["num_layers"], info.get("layer_selection") or "first", info.get("layers"))
           if info.get("num_layers") else "") + f") and distilled with draftsmith "
        f"({info['method']}, loss `{info['loss']}`) on the target's own answers{_data(info)}.", "",
        f"Tuned for target `{info['target_name']}` (fingerprint `{info['target_fingerprint']}`). "
        "Use it only with that target: acceptance depends on matching its distributions.", "",
        "```python", "out = target.generate(**inputs, assistant_model=AutoModelForCausalLM.from_pretrained(<this folder>))",
        "```", "",
    ]
    if report:
        base = report.get("baseline_drafter") or {}
        lines += [
            f"## Measured ({report.get('engine')}, K = {report.get('draft_length')}, "
            f"{_decoding(report.get('decode') or {})})", "",
            *_card_table(report, base),
            *_simulated_card_lines(report),
            *_speed_caveats(report),
        ]
    else:
        lines += ["No evaluation report was found for this drafter: run `draftsmith evaluate` to measure it.", ""]
    if info.get("draft_vocab_size"):
        lines += [
            "## Reduced draft vocabulary", "",
            f"Distilled with an EAGLE-3-style reduced vocabulary (Li et al. 2025, arXiv:2503.01840): its LM head "
            f"predicts only the {info['draft_vocab_size']:,} most frequent tokens of the target's training answers. "
            f"`{DRAFT_VOCAB_FILE}` holds the kept token ids (`draft_to_target`) and the reduced head weight; "
            "draftsmith (`distill.models.loading.load_model`, `distill.models.reduced_vocab.load_drafter`) applies it, so the head "
            "runs over those rows only and every other token gets draft probability 0 (decoding stays lossless).", "",
            "`transformers` (`from_pretrained`, `assistant_model=`), vLLM and other loaders ignore that file and load "
            "this folder as an ordinary full-vocabulary drafter (the LM head's rows for the kept tokens equal the "
            "reduced head, the others are the base model's); the GGUF file, if exported, is that full-vocabulary model too. "
            "That model is not the one measured above: the untrained rows can win the argmax, so its acceptance is lower "
            "and must be measured in the loader that uses it.",
            "",
        ]
    return "\n".join(lines)


def _card_table(report: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """The card's undistilled-vs-this-drafter table: acceptance and tau exact on every held-out prompt when the
    report has the simulation (else the timed figures), the speedup as timed."""
    sim = report.get("simulated") or {}
    where = f"exact, {sim['num_prompts']} held-out prompts" if sim else f"timed, {report.get('num_prompts')} prompts"
    pick = (lambda section, key: (section.get("simulated") or {}).get(key)) if sim else \
        (lambda section, key: section.get(key))
    return [
        "| figure | undistilled | this drafter |", "|---|---|---|",
        f"| acceptance rate ({where}) | {_or_dash(pick(base, 'acceptance_rate'), '{:.3f}')} | "
        f"{_or_dash(pick(report, 'acceptance_rate'), '{:.3f}')} |",
        f"| mean accepted tokens per target forward, incl. bonus ({where}) | "
        f"{_or_dash(pick(base, 'mean_accepted_tokens'), '{:.2f}')} | "
        f"{_or_dash(pick(report, 'mean_accepted_tokens'), '{:.2f}')} |",
        f"| speedup vs target alone (timed, {report.get('num_prompts')} prompts) | "
        f"{_or_dash(base.get('speedup'), '{:.2f}x') if base.get('timed', True) else 'not timed'} | "
        f"{_or_dash(report.get('speedup'), '{:.2f}x')} |", ""]


def _or_dash(value: float | None, fmt: str) -> str:
    """``value`` formatted, or "-" when the report has none (a drafter that was not timed)."""
    return "-" if value is None else fmt.format(value)


def _draft_vocab_size(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return int(handle.get_slice("draft_to_target").get_shape()[0])


# What an export folder holds (save_pretrained of model, tokenizer and generation config, plus ours); overwrite
# replaces a folder only when everything in it matches, so a user's own files there are never deleted.
_EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                 "model-*-of-*.safetensors", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja", DRAFTER_INFO, DRAFT_VOCAB_FILE, "README.md", GGUF_FILE)


def _run_folder_holding(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that is a stage's run folder (it has a manifest); None when
    there is none."""
    return next((folder for folder in [path, *path.parents] if (folder / MANIFEST).is_file()), None)


def export_destination(path: str | None, run_dir: Path) -> Path:
    """Where the export goes: ``export.path`` (``~`` expanded, links resolved, so that the checks and the
    overwrite act on the folder that is really written) or ``<run_dir>/drafter-hf``.

    Raises:
        ConfigError: ``export.path`` is a link loop, or a link whose target cannot be followed.
    """
    if not path:
        return Path(run_dir) / EXPORT_DIR
    given = Path(path).expanduser()
    try:
        return given.resolve(strict=False)
    except (RuntimeError, OSError) as err:  # RuntimeError: Python 3.11's "Symlink loop"
        raise ConfigError(f"export.path={given} cannot be followed ({err}): it is a symbolic link loop or a "
                          "link into a folder that cannot be read; set export.path to a real folder") from err


def check_export_destination(dest: Path, overwrite: bool, run_dir: Path | None = None) -> None:
    """Refuse a destination that exists, unless it is an empty folder, or ``overwrite`` is set and it is an
    earlier draftsmith export outside any other run's folder holding nothing but the files an export writes.
    ``dest`` is resolved already (:func:`export_destination`); ``run_dir`` is this export's own run folder.

    Raises:
        DraftsmithError: ``dest`` exists and may not (or must never) be replaced; the message names what to change.
    """
    writable = next(p for p in [dest, *dest.parents] if p.exists())
    if not os.access(writable, os.W_OK | os.X_OK):
        raise DraftsmithError(f"cannot write {dest}: {writable} is not writable by this user (permission denied); "
                              "choose another export.path")
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return
    owner = _run_folder_holding(dest)
    if owner is not None and (run_dir is None or owner.resolve() != Path(run_dir).resolve()):
        # an export run's manifest and card name the drafter it exported: replacing only its files would
        # leave a COMPLETE run whose record describes another drafter
        raise DraftsmithError(f"{dest} is inside the {recorded_stage(owner) or 'stage'} run {owner}: an export "
                              "never replaces a run's files (they are what its manifest and COMPLETE marker vouch "
                              "for); choose another export.path")
    if not dest.is_dir() or not (dest / DRAFTER_INFO).is_file():
        raise DraftsmithError(f"{dest} exists and is not a draftsmith export (no {DRAFTER_INFO}): "
                              "choose another export.path; draftsmith never replaces other files")
    if not overwrite:
        raise DraftsmithError(f"{dest} already exists: choose another export.path or set export.overwrite=true")
    foreign = sorted(p.name for p in dest.iterdir()
                     if not p.is_file() or not any(p.match(pattern) for pattern in _EXPORT_FILES))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DraftsmithError(f"{dest} is an earlier draftsmith export but also holds {shown}, which an export does "
                              "not write: move them out or choose another export.path; overwrite never deletes "
                              "other files")


def run_export(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run stage 4; returns the exported folder.

    Raises:
        IncompleteRunError: no finished distill run.
        DraftsmithError: the destination exists and ``export.overwrite`` is false.
    """
    distill_dir = resolve_input(cfg.inputs.distill, cfg.outputs, "distill")
    dest = export_destination(cfg.export.path, run_dir)
    check_export_destination(dest, cfg.export.overwrite, run_dir)
    report, eval_dir = _report_for(cfg, distill_dir)
    run = StageRun.start("export", run_dir, config_yaml,
                         inputs={"distill": str(distill_dir), "evaluate": str(eval_dir) if eval_dir else ""})
    src = distill_dir / DRAFTER_DIR
    info = json.loads((src / DRAFTER_INFO).read_text())
    target = resolve_model(cfg.target.name)  # cached after the first use: milliseconds
    if info.get("target_fingerprint") != target.fingerprint:
        raise DraftsmithError(
            f"the drafter in {distill_dir} was tuned for target {info.get('target_name')!r} (fingerprint "
            f"{str(info.get('target_fingerprint'))[:12]}), not for {cfg.target.name!r} ({target.fingerprint[:12]}): "
            f"set target.name={info.get('target_name')} (the model card names the target) or export a drafter "
            f"distilled for this target")
    dtype = getattr(torch, cfg.export.dtype)
    if info.get("kind") == "eagle3":
        return _export_head(cfg, run, src, dest, info, report)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(src)

    gguf_bytes = sum(p.numel() for p in model.parameters()) * (4 if cfg.export.gguf_dtype == "f32" else 2)
    # replace: an earlier export (or an empty folder) is swapped out only once the new folder is whole
    with atomic_dir(dest, needed_bytes=state_dict_bytes(model) + (gguf_bytes if cfg.export.gguf else 0),
                    replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        write_text_atomic(tmp / DRAFTER_INFO, json.dumps(info, indent=2) + "\n")
        if (src / DRAFT_VOCAB_FILE).is_file():  # EAGLE-3 reduced vocabulary: draftsmith's loaders apply it
            shutil.copyfile(src / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
            info = {**info, "draft_vocab_size": info.get("draft_vocab_size")
                    or _draft_vocab_size(src / DRAFT_VOCAB_FILE)}
        write_text_atomic(tmp / "README.md", model_card(info, report))
        # Prove the folder loads before it is published under its final name.
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
        probe = torch.tensor([[tokenizer.eos_token_id or 0] * 4])
        with torch.inference_mode():
            if not torch.equal(reloaded(probe).logits, model(probe).logits):
                raise DraftsmithError(f"the exported drafter in {tmp} does not reproduce the tuned one")
        if cfg.export.gguf:
            try:
                gguf_file = export_gguf(model, tokenizer, tmp, tmp / GGUF_FILE, dtype=cfg.export.gguf_dtype,
                                        name=f"draftsmith drafter for {info.get('target_name')}")
            except ValueError as err:
                raise DraftsmithError(f"GGUF export: {err}") from err
            print(f"export: wrote {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MiB, "
                  f"{cfg.export.gguf_dtype})")
    logger = make_logger(cfg.logger, run_name("export", run_dir), run_dir, config=dataclasses.asdict(cfg))
    try:
        logger.summary({"export_bytes": sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()),
                        "gguf": int(cfg.export.gguf)})
    finally:
        logger.finish()
    run.complete(export=str(dest), format="huggingface" + (" + gguf" if cfg.export.gguf else ""),
                 dtype=cfg.export.dtype, gguf=str(dest / GGUF_FILE) if cfg.export.gguf else None, drafter=info)
    return dest


def _export_head(cfg: Config, run: StageRun, src: Path, dest: Path, info: dict[str, Any],
                 report: dict[str, Any] | None) -> Path:
    """An EAGLE-3 head: the speculators folder vLLM's ``eagle3`` method loads (``distill.models.eagle3_export``),
    draftsmith's own head files beside it, the tokenizer and a model card."""
    from decode.eagle3.head import Eagle3Head
    from distill.models.eagle3_export import export_head

    if cfg.export.gguf:
        raise DraftsmithError("export.gguf=true: llama.cpp's EAGLE-3 heads are converted by its own script from a "
                              "speculators folder; export without export.gguf and convert the folder written here")
    head = Eagle3Head.load(src)
    simulated = ((report or {}).get("drafters") or {}).get("eagle3", {}).get("simulated") or {}
    draft_length = simulated.get("recommended_draft_length") or cfg.decode.draft_length
    with atomic_dir(dest, replace=True) as tmp:
        export_head(head, tmp, target_name=info.get("target_name", cfg.target.name), draft_length=draft_length,
                    dtype=getattr(torch, cfg.export.dtype))
        head.save(tmp)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        write_text_atomic(tmp / DRAFTER_INFO, json.dumps(info, indent=2) + "\n")
        write_text_atomic(tmp / "README.md", _head_card(info, simulated, draft_length))
        if not all(torch.equal(a, b) for a, b in zip(Eagle3Head.load(tmp).state_dict().values(),
                                                     head.state_dict().values())):
            raise DraftsmithError(f"the exported head in {tmp} does not reproduce the trained one")
    run.complete(export=str(dest), format="speculators eagle3 (vLLM)", dtype=cfg.export.dtype, gguf=None, drafter=info)
    print(f"export: the EAGLE-3 head in {dest} (vLLM: speculative_config={{'method': 'eagle3', 'model': '{dest}', "
          f"'num_speculative_tokens': {draft_length}}})")
    return dest


def _head_card(info: dict[str, Any], simulated: dict[str, Any], draft_length: int) -> str:
    """The head's model card: what it is, for which target, and its measured acceptance if evaluated."""
    lines = [f"# EAGLE-3 head for {info.get('target_name')}", "",
             f"Trained by draftsmith: aux layers {info.get('aux_layers')}, draft vocabulary "
             f"{info.get('draft_vocab_size')}, {info.get('ttt_steps')} training-time-test steps, started from "
             f"{info.get('head_init')}.", "",
             f"vLLM: `speculative_config={{\"method\": \"eagle3\", \"model\": \"<this folder>\", "
             f"\"num_speculative_tokens\": {draft_length}}}`."]
    if simulated:
        lines += ["", f"Measured by draftsmith evaluate on {simulated.get('num_prompts')} held-out prompts (exact, "
                  f"greedy, K = {simulated.get('draft_length')}): acceptance {simulated.get('acceptance_rate'):.3f}, "
                  f"tau {simulated.get('mean_accepted_tokens'):.2f}."]
    return "\n".join(lines) + "\n"
