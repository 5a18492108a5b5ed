"""Stage 3: measure the drafter before and after distillation with the bundled decoder.

On the held-out evaluation prompts of the generate run (never trained on), or on
the prompt file named by ``evaluate.prompts``, the target decodes alone, with the
tuned drafter (ours and, optionally, transformers' assisted generation) and with
the undistilled drafter. Writes ``report.json``
(figures of the tuned drafter at top level, the undistilled one under
``baseline_drafter``) and ``report.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decode.acceptance import MAX_SIMULATED_K, paired_tau_difference
from decode.benchmark import MIN_VERIFY_LENGTHS, VERIFY_ROUNDS, benchmark, run_target_alone
from decode.costs import machine_busy, measure_cost_ratios, timed_verify_costs
from decode.cpu_linear import use_onednn_linear
from decode.quantization import drafter_for_decoding, resolve_quantization
from decode.timing import CpuWatch
from distill import parallel
from distill.config import Config
from distill.data.generated import load_generated
from distill.data.prompts import Prompt, encode_prompt, load_prompts
from distill.drafters.setup import DRAFTER_DIR, DRAFTER_INFO, check_tokenizers, initial_drafter
from distill.errors import ConfigError, DraftsmithError
from distill.files import write_json_atomic
from distill.hardware import hardware, process_device, release_memory
from distill.measure.budget import budget_curve, warn_no_checkpoints
from distill.measure.engines import check_engines, measure_engine
from distill.measure.head_evaluation import is_head_run, run_head_evaluate
from distill.measure.report import REPORT_JSON, REPORT_MD, ratio_or_none, write_report_markdown, write_report_plots
from distill.measure.standing import load_reference, standing, training_recipe
from distill.measure.simulation import (
    Pairing,
    answer_all,
    answers_target_key,
    paired_against,
    pairing_of,
    prompt_lookup_section,
    ratio_with_costs,
    settings_of,
    shared_body_groups,
    simulated_choice,
    simulated_drafter,
    simulation_check,
    teacher_forced,
    teacher_forced_shared,
)
from distill.measure.quiet_costs import fallback_costs, remember
from distill.measure.timing_trust import report_timing
from distill.models.loading import eos_token_ids, load_model, resolve_model
from distill.models.reduced_vocab import (
    DRAFT_VOCAB_FILE,
    draft_vocabulary_of,
    load_drafter,
    reduce_for_training,
    reduce_vocabulary,
    reduced_head,
)
from distill.runs import StageRun, peak_rss_bytes, read_manifest, require_complete, resolve_input
from distill.training.checkpoint import budget_checkpoints, checkpoint_tokens, trained_drafter_at
from distill.training.resume import CHECKPOINTS
from distill.tracking import make_logger, run_name


def load_tuned_drafter(distill_dir: Path, dtype: str):
    """The merged drafter of a finished distill run (eval mode; reduced to its draft vocabulary when the
    folder has ``draft_vocab.safetensors``, see :func:`distill.models.reduced_vocab.load_drafter`) and its
    ``drafter_info.json``."""
    path = require_complete(distill_dir, "distill") / DRAFTER_DIR
    model = load_drafter(path, dtype)  # with its reduced vocabulary head if it was distilled with one
    return model, json.loads((path / DRAFTER_INFO).read_text())


def evaluation_prompts(cfg: Config, held_out: list[Prompt], gen_dir: Path) -> list[Prompt]:
    """The prompts evaluate decodes: the first ``evaluate.num_prompts`` of ``evaluate.prompts`` when set (a
    prompt file in the format ``data=file`` reads), else of the generate run's held-out prompts ``held_out``.

    Warns (does not fail) when there are fewer than ``evaluate.num_prompts``.

    Raises:
        PromptError: ``evaluate.prompts`` is missing, empty or malformed (every bad line listed).
    """
    wanted = cfg.evaluate.num_prompts
    if cfg.evaluate.prompts:
        prompts = load_prompts("file", str(cfg.evaluate.prompts), limit=wanted, key="evaluate.prompts")
        if len(prompts) < wanted:
            print(f"evaluate: warning: {cfg.evaluate.prompts} holds {len(prompts)} prompts, fewer than "
                  f"evaluate.num_prompts={wanted}: evaluating on {len(prompts)}")
        return prompts
    if len(held_out) < wanted:
        print(f"evaluate: warning: {gen_dir} holds {len(held_out)} held-out prompts, fewer than "
              f"evaluate.num_prompts={wanted}; the eval set is fixed when generate runs "
              f"(re-run generate with evaluate.num_prompts={wanted}, or name a prompt file: evaluate.prompts=<file>)")
    return held_out[:wanted]


def prompts_seen_in_training(prompt_ids: list[list[int]], distill_dir: Path) -> int | None:
    """How many of the encoded prompts ``prompt_ids`` (token ids, as the target reads them) were prompts of the
    generate runs ``distill_dir`` was distilled on (its ``inputs.generate`` and ``inputs.extra_generate``,
    training and validation split alike); None when one of those runs is gone, so the overlap is unknown."""
    inputs = read_manifest(distill_dir).get("inputs", {})
    seen: set[tuple[int, ...]] = set()
    for folder in filter(None, [inputs.get("generate"), *inputs.get("extra_generate", [])]):
        try:
            dataset = load_generated(Path(folder))[0]
        except DraftsmithError:
            return None
        seen.update(tuple(ids) for ids in dataset.select_columns(["prompt_ids"])["prompt_ids"])
    return sum(tuple(ids) in seen for ids in prompt_ids)


def _log_report(cfg: Config, run_dir: Path, report: dict[str, Any], plots: list[Path]) -> None:
    """Send the headline figures (and plots, for wandb) to the configured logger."""
    logger = make_logger(cfg.logger, run_name("evaluate", run_dir), run_dir, config=asdict(cfg))
    try:
        base = report.get("baseline_drafter") or {}
        figures = {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        figures.update({f"baseline_drafter/{k}": v for k, v in base.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for name, other in (report.get("compared_drafters") or {}).items():
            figures.update({f"{name}/{k}": v for k, v in other.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
        logger.summary(figures)
        for plot in plots:
            if hasattr(logger, "log_image"):
                logger.log_image(plot.stem, plot)
    finally:
        logger.finish()


def _as_distilled(cfg: Config, info: dict[str, Any]) -> Config:
    """``cfg`` with ``drafter.*`` set to how the distilled drafter was built (``drafter_info.json``), so the
    undistilled baseline is the same drafter before training even when the command's drafter.* differs."""
    drafter = dataclasses.replace(
        cfg.drafter, name=info.get("base_name") or cfg.drafter.name, init=info.get("init") or cfg.drafter.init,
        num_layers=info.get("num_layers"), layer_selection=info.get("layer_selection") or "first",
        layers=info.get("layers"))
    return dataclasses.replace(cfg, drafter=drafter)


def _measure_drafter(cfg: Config, ev: "_Evaluation", alone, runner, key: str, *, costs: dict[str, Any],
                     samples: dict[str, list], hf_assisted: bool = False, check: bool = False,
                     verify_costs: list[float] | None = None, verify_rounds: list[list[float]] | None = None,
                     untimed_like: dict[str, Any] | None = None) -> tuple[dict[str, Any], Pairing]:
    """One drafter as the decoder runs it (``runner``, named ``key`` in ``costs`` and ``samples``): timed on
    ``ev.timed`` (``decode.benchmark``), then its exact acceptance on every prompt's answer under ``simulated``
    from its teacher-forced pass ``samples[key]`` (and ``simulation_check`` with ``check``); returns the figures
    and its per-prompt block totals (:class:`Pairing`, for paired differences). The predicted speedups take c
    from ``costs`` (every drafter timed side by side, :func:`decode.costs.measure_cost_ratios`) and
    ``verify_costs`` (the target's, from the first drafter's run, with its timing rounds ``verify_rounds``), so
    that between drafters only c differs, measured alike; their intervals resample those timing rounds. With
    ``untimed_like`` (the distilled drafter's figures) it is not decoded in real time: its section holds the
    simulated figures alone, at that drafter's K (``evaluate.timed_drafters=distilled``)."""
    start = time.perf_counter()
    if untimed_like is None:
        figures = benchmark(ev.target, runner, ev.timed, hf_assisted=hf_assisted, target_outputs=alone,
                            verify_costs=verify_costs, forward_costs=(costs["target_forward_ms"] / 1000,
                                                                      costs["cost_ratios"][key]), **ev.settings)
        figures["timed"] = True
        seconds = {"timed_decoding": time.perf_counter() - start}
    else:
        figures = {"timed": False, "draft_length": untimed_like.get("draft_length"),
                   "draft_length_choice": {"cost_ratio": costs["cost_ratios"][key], "verify_costs":
                                           (untimed_like.get("draft_length_choice") or {}).get("verify_costs")}}
        seconds = {}
    seconds["teacher_forced"] = ev.teacher_forced_seconds[key]
    simulation = settings_of(cfg.decode, figures)
    model_costs = {"cost_ratio": costs["cost_ratios"][key], "verify_costs": verify_costs or figures.get("verify_costs"),
                   "cost_ratio_rounds": (costs.get("cost_ratio_rounds") or {}).get(key),
                   "verify_cost_rounds": verify_rounds if verify_costs else figures.get("verify_cost_rounds")}
    figures["simulated"], totals = simulated_drafter(samples[key], simulation, model_costs, cfg.evaluate.seed)
    figures["simulated"]["cost_ratio"] = model_costs["cost_ratio"]  # side by side, as the timed run's
    figures["draft_length_choice"] = simulated_choice(figures["simulated"], figures.get("draft_length_choice"))
    if check:
        start = time.perf_counter()
        figures["simulation_check"] = simulation_check(runner, figures, ev.timed, simulation, ev.vocab)
        seconds["simulation_check"] = time.perf_counter() - start
    figures["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    return figures, pairing_of(samples[key], simulation, figures["simulated"], totals, model_costs)


def _as_runner(model, quantization: str):
    """``model`` as the decoder runs it (``decode.quantization.drafter_for_decoding``, in place: ``model`` is the
    runner afterwards), without the full-vocabulary head a reduced one keeps for saving."""
    # in place as soon as each drafter is loaded, so that one float copy exists at a time: 0.5B drafters side by
    # side take about 1.1 GB each as int8 instead of 2.5 GB in float32 (an AVX2 host's dtype)
    runner = drafter_for_decoding(model.to(process_device()), quantization, inplace=True)
    head = reduced_head(runner)
    if head is not None:
        head.full_weight = None
    release_memory()
    return runner


def _measure_the_others(cfg: Config, report: dict[str, Any], tuned: Pairing, measure, runners: dict[str, Any],
                        draft_vocab, prompts, answers, checkpoints: list[str] = ()) -> None:
    """The undistilled drafter (with the paired difference), ``evaluate.compare_drafters`` (the stock drafter
    among them when :func:`_reference_drafters` added it) and prompt lookup, measured like the distilled one
    into ``report``; ``runners`` is emptied as each is done (memory). Every model drafter then gets
    ``against_stock`` (:func:`_against_stock`), and each of ``checkpoints`` (``evaluate.checkpoints``) its
    ``paired_difference`` against the undistilled one."""
    dec = cfg.decode
    pairings = {"distilled": tuned}
    verify = report.get("verify_costs")
    measure = functools.partial(measure, verify_costs=verify, verify_rounds=report.get("verify_cost_rounds"))
    untimed = ""
    if cfg.evaluate.timed_drafters != "all":  # exact tau and side-by-side c predict their speed; no decoding
        measure = functools.partial(measure, untimed_like=report)
        untimed = ", simulated (not timed: evaluate.timed_drafters=distilled)"
    if "undistilled" in runners:
        print(f"evaluate: undistilled drafter on the same prompts{untimed}")
        report["baseline_drafter"], pairings["undistilled"] = measure(runners.pop("undistilled"), "undistilled")
        report["paired_difference"] = {
            **paired_tau_difference(tuned.at_k, pairings["undistilled"].at_k, seed=cfg.evaluate.seed),
            "of": "distilled minus undistilled, simulated tau on the same prompts",
            # each at the K it ran with: they differ only under decode.schedule=auto with both timed (an untimed
            # drafter is simulated at the distilled drafter's K)
            "draft_lengths": [report["simulated"]["draft_length"], report["baseline_drafter"]["simulated"]["draft_length"]]}
        if draft_vocab is not None:
            report["baseline_drafter"]["draft_vocab_size"] = int(draft_vocab.numel())
    if runners:
        report["compared_drafters"] = {}
    for name in list(runners):
        print(f"evaluate: {name} (evaluate.compare_drafters) on the same prompts{untimed}")
        report["compared_drafters"][name], pairings[name] = measure(runners.pop(name), name)
    for name in checkpoints if "undistilled" in pairings else ():
        report["compared_drafters"][name]["paired_difference"] = {
            **paired_tau_difference(pairings[name].at_k, pairings["undistilled"].at_k, seed=cfg.evaluate.seed),
            "of": f"{name} minus undistilled, simulated tau on the same prompts"}
    _against_stock(cfg, report, pairings)
    if cfg.evaluate.prompt_lookup:
        lookup = prompt_lookup_section(prompts, answers, settings_of(dec, report), verify, cfg.evaluate.seed)
        if lookup:
            report["baselines"]["prompt_lookup"] = lookup


def _against_stock(cfg: Config, report: dict[str, Any], pairings: dict[str, Pairing]) -> None:
    """``against_stock`` in every drafter's section: it against the stock drafter (the base model as shipped,
    whole and with its full vocabulary: what a user decodes with without draftsmith) on the same prompts, the
    tau difference and the predicted-speedup ratio at each one's best K (paired intervals over prompts and
    timing rounds), the same ratio with the fallback c (:func:`distill.measure.quiet_costs.fallback_costs`,
    for where the timing was disturbed), and the timed subset's speedup ratio. The stock drafter is the
    undistilled one for a whole sibling drafter, else the ``compare_drafters`` entry named
    ``drafter.base_name``; nothing is added when neither was measured."""
    sections = {"distilled": report, "undistilled": report.get("baseline_drafter"),
                **(report.get("compared_drafters") or {})}
    stock = report["drafter_stock"] = _stock_key(report, pairings)
    if stock is None:
        return
    for key, pairing in pairings.items():
        if key == stock:
            continue
        section = sections[key]
        section["against_stock"] = {**paired_against(pairing, pairings[stock], cfg.evaluate.seed),
                                    "timed_speedup_ratio": ratio_or_none(section.get("speedup"), sections[stock].get("speedup"))}
        fallback = (report.get("side_by_side_costs") or {}).get("cost_ratio_fallback") or {}
        c_pair = tuple((fallback.get(k) or {}).get("cost_ratio") for k in (key, stock))
        by_fallback = ratio_with_costs(pairing, pairings[stock], c_pair, cfg.evaluate.seed)
        if by_fallback:  # where timing cannot be trusted: c from this host's quiet runs or from shapes
            by_fallback["sources"] = [fallback[k]["source"] for k in (key, stock)]
            section["against_stock"]["predicted_speedup_ratio_fallback"] = by_fallback


def _stock_key(report: dict[str, Any], pairings: dict[str, Pairing]) -> str | None:
    """Which measured drafter of ``pairings`` is the stock one (see :func:`_against_stock`), or None."""
    info = report.get("drafter") or {}
    whole = info.get("init", "sibling") == "sibling" and not info.get("draft_vocab_size")
    if whole and "undistilled" in pairings:
        return "undistilled"
    return info.get("base_name") if info.get("base_name") in pairings else None


def run_evaluate(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path | None:
    """Run stage 3 into ``run_dir``; returns the path of ``report.json``.

    Of N launched processes (``torchrun``, ``accelerate launch``) each loads the models and computes every
    N-th batch of the target's answers (when generate left none) and of each drafter's teacher-forced pass;
    the main process alone then times the decoder, simulates and writes the run folder, and the others return
    None (timings want the machine to themselves).

    Raises:
        IncompleteRunError: no finished distill (or generate) run to read.
        DraftsmithError: the drafter was tuned for another target than ``target.name``.
    """
    distill_dir = resolve_input(cfg.inputs.distill, cfg.outputs, "distill")
    if not cfg.inputs.distill:  # with reused runs the newest is not always the last command's: say which
        print(f"evaluate: evaluating {distill_dir}, the newest finished distill run under {cfg.outputs} "
              "(inputs.distill=<run> picks another)")
    distill_manifest = read_manifest(distill_dir)
    trained_on = Path(distill_manifest["inputs"]["generate"])
    gen_dir = require_complete(cfg.inputs.generate, "generate") if cfg.inputs.generate else trained_on
    _, held_out, gen_manifest = load_generated(gen_dir)
    held_out = evaluation_prompts(cfg, held_out, gen_dir)  # a bad evaluate.prompts file fails here, before loading
    check_engines(cfg.evaluate.engines, cfg.evaluate.llama_cpp_bin)
    if cfg.evaluate.engines:
        _check_engine_drafter(json.loads((distill_dir / DRAFTER_DIR / DRAFTER_INFO).read_text()),
                              reduced=(distill_dir / DRAFTER_DIR / DRAFT_VOCAB_FILE).is_file())
    run = StageRun.start("evaluate", run_dir, config_yaml, inputs={"distill": str(distill_dir), "generate": str(gen_dir)}) \
        if parallel.is_main() else None
    if is_head_run(distill_dir):  # an EAGLE-3 head: its own measurements beside the stock drafter, one process
        return run_head_evaluate(cfg, run, distill_dir, held_out, gen_dir) if run is not None else None

    laps = _Laps()
    ev = _load_evaluation(cfg, distill_dir, held_out, trained_on)
    ev.eval_set = _evaluation_set(cfg, ev.prompts, distill_dir, gen_dir, trained_on)
    laps("load_models")
    print(f"evaluate: the target's answers to all {len(ev.prompts)} {'held-out ' if not cfg.evaluate.prompts else ''}"
          f"prompts (generate's, or answered now, batched), for the exact acceptance of every drafter")
    ev.answers = answer_all(ev.target, ev.prompts, cfg.decode, eos=ev.eos, pad_id=ev.pad_id,
                            batch_size=cfg.generate.batch_size, batch_tokens=cfg.generate.batch_tokens,
                            seed=cfg.evaluate.seed, cache_dir=Path(cfg.outputs) / ".shards", look_in=(gen_dir,),
                            target_key=answers_target_key(ev.target_res.fingerprint, cfg.target.dtype, ev.target),
                            tokenizer=ev.tokenizer)
    laps("target_answers")
    samples = _teacher_forced_passes(cfg, ev)
    laps("teacher_forced")
    processes = parallel.rank_and_size()[1]
    # the last collective: the other processes end now instead of waiting out the timed decoding in a barrier,
    # which the process group's timeout (30 min on gloo, 10 on NCCL) would break
    parallel.finish()
    if run is None:
        return None
    if processes > 1:
        _take_the_machine()
    report = _timed_and_simulated(cfg, ev, samples, laps)
    report.update({
        "target": {"name": cfg.target.name, "fingerprint": ev.target_res.fingerprint, "dtype": cfg.target.dtype},
        "drafter": {**report["drafter"], "dtype": cfg.drafter.dtype, "path": str(distill_dir / DRAFTER_DIR),
                    "parameters": ev.tuned_parameters},
        "decode": {**asdict(cfg.decode), "drafter_quantization_used": ev.quantization,
                   "draft_length_used": ev.settings["draft_length"]},
        "prompt_ids": [p[0] for p in ev.prompts],
        "eval_prompts": ev.eval_set,  # held-out (the generate run's) or evaluate.prompts, with its training overlap
        "distill_inputs": distill_manifest.get("inputs", {}),  # the generate runs it was trained on
    })
    _add_notes(cfg, report, ev.quantization, ev.busy, gen_manifest)
    if not report["timing"]["disturbed"]:
        remember(report["side_by_side_costs"], str(run_dir))
    _add_distill_validation(report, distill_manifest)
    if cfg.evaluate.engines:
        report["engines"] = _engine_measurements(cfg, ev, report, distill_dir, run_dir)
        laps("engines")
    train = distill_manifest.get("train") or {}
    report["training"] = {"tokens": train.get("tokens_seen"), "steps": train.get("steps"),
                          "recipe": training_recipe(distill_dir)}
    if ev.checkpoints:
        report["budget_curve"] = budget_curve(report, ev.checkpoints, {"step": train.get("steps"),
                                              "tokens_seen": train.get("tokens_seen", 0)}, train.get("tokens_per_s"))
    else:  # one point: where it stands on the reference curve measured with checkpoints
        report["curve_standing"] = standing(report, load_reference())
    report["phase_seconds"] = laps.seconds  # where evaluate's time went (each drafter's own split: its "seconds")
    report["phase_peak_rss_gib"] = laps.peak_gib
    report_path = _write_report(cfg, report, run_dir, distill_dir)
    run.complete(artifacts=(REPORT_JSON,), report=str(report_path), model_load_s=round(ev.load_s, 2),
                 speedup=report.get("speedup"), acceptance_rate=report.get("acceptance_rate"),
                 processes=processes)
    return report_path


def _engine_measurements(cfg: Config, ev: "_Evaluation", report: dict[str, Any], distill_dir: Path,
                         run_dir: Path) -> dict:
    """``report["engines"]``: the distilled and the stock drafter in each of ``evaluate.engines``, after the torch
    models are freed (an engine loads its own copies). Only a whole sibling drafter runs in an engine as is."""
    dtype = str(next(ev.target.parameters()).dtype).removeprefix("torch.")
    ev.target, ev.runners = None, {}
    release_memory()
    drafters = {"distilled": distill_dir / DRAFTER_DIR}
    per_k = {"distilled": report["simulated"]["per_k"]}
    stock = (report.get("baseline_drafter") or {}).get("simulated")
    if stock:  # evaluate.baseline=false measures no stock drafter: the engines run the distilled one alone
        drafters["undistilled"], per_k["undistilled"] = resolve_model(cfg.drafter.name).path, stock["per_k"]
    prompts = [p[2] for p in ev.timed]
    out = {}
    for name in cfg.evaluate.engines:
        try:
            out[name] = measure_engine(name, cfg.target.name, ev.target_res.path, drafters, per_k, prompts,
                                       dtype=dtype, max_new_tokens=cfg.decode.max_new_tokens,
                                       draft_length=ev.settings["draft_length"], work_dir=run_dir / ".engines",
                                       llama_cpp_bin=cfg.evaluate.llama_cpp_bin)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the torch figures stand without it
            print(f"evaluate: {name} failed, reported as such: {exc}")
            out[name] = {"error": str(exc)}
    return out


def _check_engine_drafter(info: dict[str, Any], reduced: bool) -> None:
    """Raises:
        ConfigError: ``evaluate.engines`` asked for a drafter an engine cannot load as it is (pruned, or with a
            reduced vocabulary), before any model loads.
    """
    if info.get("init") != "sibling" or reduced or info.get("draft_vocab_size"):
        raise ConfigError("evaluate.engines runs a whole sibling drafter with its full vocabulary in vLLM and "
                          f"llama.cpp; this one is {info.get('init')} with draft_vocab_size "
                          f"{info.get('draft_vocab_size')}: drop evaluate.engines for this run")


def _take_the_machine() -> None:
    """The main process of several, alone from here: every CPU thread for the timed decoding (a launcher gives
    each process one), after the other processes have had a moment to exit (their teardown would count as a
    busy machine)."""
    time.sleep(2.0)
    if not torch.cuda.is_available():
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


@dataclass
class _Evaluation:
    """What evaluate measures with: the target, every drafter as the decoder runs it (``runners``: ``distilled``,
    ``undistilled``, then the compared ones by name), the prompts ``(id, category, token ids)`` and the settings."""

    target: Any
    tokenizer: Any
    target_res: Any
    info: dict[str, Any]
    runners: dict[str, Any]
    prompts: list
    timed: list
    settings: dict[str, Any]
    vocab: int
    quantization: str
    tuned_vocab_size: int | None
    tuned_parameters: int
    load_s: float
    eos: list[int]
    pad_id: int
    busy: float | None = None
    eval_set: dict[str, Any] = dataclasses.field(default_factory=dict)
    answers: list[list[int]] = dataclasses.field(default_factory=list)
    teacher_forced_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    checkpoints: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # evaluate.checkpoints' steps


def _load_evaluation(cfg: Config, distill_dir: Path, held_out: list[Prompt], trained_on: Path) -> _Evaluation:
    """The target and every drafter, each drafter made its decoding self as it is loaded (:func:`_as_runner`),
    the encoded prompts and the decoder settings."""
    target, tokenizer, target_res, tuned, info, load_s = _load_models(cfg, distill_dir)
    tuned_parameters = sum(p.numel() for p in tuned.parameters())
    tuned_vocab = draft_vocabulary_of(tuned)
    dec = cfg.decode
    eos = eos_token_ids(target, tokenizer)
    prompts = [(p.id, p.category, encode_prompt(tokenizer, p)) for p in held_out]
    quantization = resolve_quantization(dec.drafter_quantization, target.device)
    as_runner = functools.partial(_as_runner, quantization=quantization)
    runners = {"distilled": as_runner(tuned)}
    del tuned
    runners.update(_reference_drafters(cfg, info, runners["distilled"], tokenizer,
                                       _training_completions(cfg, trained_on), as_runner))
    checkpoint_runners, checkpoints = _checkpoint_drafters(cfg, distill_dir, info, tuned_vocab, as_runner)
    runners.update(checkpoint_runners)
    use_onednn_linear(target)  # float32 on a CPU: few-token forwards through oneDNN (decode.cpu_linear)
    settings = dict(draft_length=dec.draft_length, schedule=dec.schedule, max_draft_length=dec.max_draft_length,
                    confidence_threshold=dec.confidence_threshold, target_engine=cfg.evaluate.target_engine,
                    **_decode_args(cfg, eos, tokenizer))
    return _Evaluation(
        target, tokenizer, target_res, info, runners, prompts, prompts[:cfg.evaluate.timed_prompts], settings,
        vocab=min(m.get_output_embeddings().out_features for m in (target, *runners.values())),
        quantization=quantization, tuned_vocab_size=None if tuned_vocab is None else int(tuned_vocab.numel()),
        tuned_parameters=tuned_parameters, load_s=load_s, eos=eos,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0], checkpoints=checkpoints)


def _decode_args(cfg: Config, eos: list[int], tokenizer) -> dict[str, Any]:
    """What every decoder run (target alone, speculative, HF assisted) takes from ``decode.*``."""
    dec = cfg.decode
    return dict(max_new_tokens=dec.max_new_tokens, eos_token_ids=eos, temperature=dec.temperature, top_k=dec.top_k,
                top_p=dec.top_p, seed=cfg.evaluate.seed, stop_strings=list(dec.stop_strings), tokenizer=tokenizer)


def _teacher_forced_passes(cfg: Config, ev: _Evaluation) -> dict[str, list]:
    """Each drafter's teacher-forced pass over the target's answers (``decode.acceptance``'s input), keyed as
    ``ev.runners``; the seconds each took go to ``ev.teacher_forced_seconds``. Greedy drafters with equal
    decoder layers (the stock drafter and its untrained reduced heads) share one pass of those layers, its
    seconds split among them. Of N processes each computes every N-th batch and all get the whole."""
    samples = {}
    tokens = sum(map(len, ev.answers))
    groups = shared_body_groups(ev.runners) if cfg.decode.temperature == 0 else [[k] for k in ev.runners]
    for group in groups:
        start = time.perf_counter()
        if len(group) == 1:
            print(f"evaluate: {group[0]} drafter, teacher-forced over the {tokens} answer tokens")
            samples[group[0]] = teacher_forced(ev.target, ev.runners[group[0]], ev.prompts, ev.answers, cfg.decode,
                                               ev.vocab)
        else:
            print(f"evaluate: {', '.join(group)}: one teacher-forced pass of their shared layers over the {tokens} "
                  f"answer tokens, each head on its output")
            samples.update(teacher_forced_shared({k: ev.runners[k] for k in group}, ev.prompts, ev.answers, ev.vocab))
        for key in group:
            ev.teacher_forced_seconds[key] = (time.perf_counter() - start) / len(group)
    return samples


def _timed_and_simulated(cfg: Config, ev: _Evaluation, samples: dict[str, list], laps: "_Laps") -> dict[str, Any]:
    """The timed runs on ``ev.timed`` (target alone, c side by side, each drafter) and every drafter's
    simulated figures: the report's body, the distilled drafter's figures at its top level, and ``timing``
    (:func:`distill.measure.timing_trust.report_timing`: whether the machine disturbed the timing)."""
    ev.busy = machine_busy("evaluate")
    with CpuWatch() as watch:
        report = _timed_drafters(cfg, ev, samples, laps)
    report["timing"] = report_timing(report["side_by_side_costs"], report.get("verify_cost_rounds"),
                                     report["draft_length"], ev.busy, watch.others_share)
    if report["timing"]["disturbed"] and not torch.cuda.is_available():
        print("evaluate: warning: the timing was disturbed: " + "; ".join(report["timing"]["reasons"]) +
              ". Acceptance is exact; speed verdicts are withheld (re-run on an idle machine)", flush=True)
    return report


def _timed_drafters(cfg: Config, ev: _Evaluation, samples: dict[str, list], laps: "_Laps") -> dict[str, Any]:
    """:func:`_timed_and_simulated` without the timing check."""
    runners = ev.runners  # emptied as each drafter is done (memory)
    print(f"evaluate: target alone on {len(ev.timed)} of them, timed (evaluate.timed_prompts)")
    alone = run_target_alone(ev.target, ev.timed, vocab_size=ev.vocab, engine=cfg.evaluate.target_engine,
                             **_decode_args(cfg, ev.eos, ev.tokenizer))
    laps("target_alone")
    print(f"evaluate: c of the {len(runners) - len(ev.checkpoints)} drafters, timed side by side (interleaved rounds on "
          f"{min(3, len(ev.timed))} prompts, more rounds while they disagree)")
    timed = {k: v for k, v in runners.items() if k not in ev.checkpoints}  # a checkpoint has the distilled shapes
    costs = measure_cost_ratios(ev.target, timed, [ids for _, _, ids in ev.timed[:3]], seed=cfg.evaluate.seed)
    _share_costs(costs, "distilled", list(ev.checkpoints))
    costs["cost_ratio_fallback"] = fallback_costs(costs)  # stands in, labelled, where the timing was disturbed
    laps("cost_ratios")
    measure = functools.partial(_measure_drafter, cfg, ev, alone, costs=costs, samples=samples)
    chosen = _choose_draft_length(cfg, ev, samples["distilled"], costs)
    if chosen:
        laps("draft_length_choice")
    print(f"evaluate: distilled drafter, timed at K = {ev.settings['draft_length']}")
    verify = (chosen or {}).get("verify")
    report, tuned_pairing = measure(runners.pop("distilled"), "distilled", hf_assisted=cfg.evaluate.hf_assisted,
                                    check=True, verify_costs=verify and verify["costs"],
                                    verify_rounds=verify and verify["rounds"])
    if verify:  # measured here before the timed run, as benchmark would have measured them after it
        report["verify_cost_rounds"], report["verify_costs_measured"] = verify["rounds"], verify["measured"]
    if chosen:
        report["draft_length_from"] = chosen["summary"]
    report["drafter"] = {**ev.info, "draft_vocab_size": ev.tuned_vocab_size}  # which drafter is stock reads it
    report["side_by_side_costs"] = costs
    laps("distilled_drafter")
    draft_vocab = draft_vocabulary_of(runners["undistilled"]) if "undistilled" in runners else None
    _measure_the_others(cfg, report, tuned_pairing, measure, runners, draft_vocab, ev.prompts, ev.answers,
                        checkpoints=list(ev.checkpoints))
    laps("other_drafters")
    return report


def _choose_draft_length(cfg: Config, ev: _Evaluation, distilled: list, costs: dict[str, Any]) -> dict[str, Any] | None:
    """``evaluate.draft_length=recommended``: the K the timed runs decode at, set in ``ev.settings``: the one of
    the highest predicted speedup for the distilled drafter, from its exact simulation on every evaluation prompt
    at K = 1..16 (``distilled``: its teacher-forced pass), its c timed side by side (``costs``) and the target's
    verification costs, timed here on the first 3 timed prompts as the benchmark times them. Returns the
    verification costs (``verify``: ``costs``, ``rounds``, ``measured``, reused by the timed run where they
    reach the chosen K) and the report's ``draft_length_from``; None where K stays ``decode.draft_length``
    (``evaluate.draft_length=decode``, or a schedule other than constant, which sets its own K)."""
    if cfg.evaluate.draft_length != "recommended" or cfg.decode.schedule != "constant":
        return None
    calibration = [ids for _, _, ids in ev.timed[:3]]
    wanted = min(max(MIN_VERIFY_LENGTHS, cfg.decode.draft_length), MAX_SIMULATED_K) + 1
    print(f"evaluate: the target's verification costs (1..{wanted} tokens) and the distilled drafter's exact tau at "
          f"K = 1..{MAX_SIMULATED_K}, to decode at the K they recommend (evaluate.draft_length=recommended)")
    verify_costs, measured, rounds = timed_verify_costs(ev.target, calibration, wanted, rounds=VERIFY_ROUNDS,
                                                       progress=True)
    model_costs = {"cost_ratio": costs["cost_ratios"]["distilled"], "verify_costs": verify_costs,
                   "cost_ratio_rounds": (costs.get("cost_ratio_rounds") or {}).get("distilled"),
                   "verify_cost_rounds": rounds}
    section, _ = simulated_drafter(distilled, settings_of(cfg.decode, {}), model_costs, cfg.evaluate.seed)
    best = int(section["recommended_draft_length"])
    ev.settings["draft_length"] = best
    by_k = {int(k): v["predicted_speedup"] for k, v in section["per_k"].items()}
    print(f"evaluate: K = {best} recommended (predicted {by_k[best]:.2f}x; K = {cfg.decode.draft_length}, "
          f"decode.draft_length: {by_k.get(cfg.decode.draft_length, float('nan')):.2f}x)")
    # the timed run measures more lengths itself when the chosen K needs them (benchmark._measure_costs)
    reuse = min(max(MIN_VERIFY_LENGTHS, best), MAX_SIMULATED_K) + 1 <= wanted
    return {"verify": {"costs": verify_costs, "rounds": rounds, "measured": measured} if reuse else None,
            "summary": {"setting": "recommended", "decode_draft_length": cfg.decode.draft_length, "chosen": best,
                        "predicted_speedup_by_k": by_k, "num_prompts": section["num_prompts"],
                        "source": "the distilled drafter's exact simulated tau at each K, c timed side by side, "
                                  "the target's verification costs timed before the timed runs"}}


class _Laps:
    """Wall seconds of evaluate's phases in order: ``laps(name)`` closes the phase that ran since the last call
    and notes the process's peak resident memory so far (``peak_gib``: which phase set the stage's peak)."""

    def __init__(self) -> None:
        self._phases: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases[phase] = now - self._last
        self.peak_gib[phase] = round(peak_rss_bytes() / 2**30, 2)
        self._last = now

    @property
    def seconds(self) -> dict[str, float]:
        """``{phase: seconds, ..., "total": their sum}``, rounded to 0.1 s."""
        return {k: round(v, 1) for k, v in {**self._phases, "total": sum(self._phases.values())}.items()}


def _load_models(cfg: Config, distill_dir: Path):
    """The target and the tuned drafter: ``(target, tokenizer, target's ResolvedModel, tuned, its info, seconds)``.

    Raises:
        DraftsmithError: the drafter was tuned for another target than ``target.name``.
    """
    t0 = time.perf_counter()
    # one line per model: loading and making int8 take 40-60 s in all on a CPU, which a silent terminal hides
    print(f"evaluate: loading the target {cfg.target.name} ({cfg.target.dtype})", flush=True)
    target, tokenizer, target_res = load_model(cfg.target.name, dtype=cfg.target.dtype)
    target = target.to(process_device())
    print(f"evaluate: loading the distilled drafter from {distill_dir}", flush=True)
    tuned, info = load_tuned_drafter(distill_dir, cfg.drafter.dtype)
    if info["target_fingerprint"] != target_res.fingerprint:
        raise DraftsmithError(
            f"the drafter in {distill_dir} was tuned for target {info['target_name']!r} "
            f"(fingerprint {info['target_fingerprint'][:12]}), not for {cfg.target.name!r} "
            f"({target_res.fingerprint[:12]}): set target.name={info['target_name']} or distil a drafter for this target")
    return target, tokenizer, target_res, tuned, info, time.perf_counter() - t0


def _write_report(cfg: Config, report: dict[str, Any], run_dir: Path, distill_dir: Path) -> Path:
    """The host and engine figures, ``report.json`` (atomically), the plots, the logger's copy and ``report.md``;
    returns the path of ``report.json``. The report is written before the plots, so a disk that fills up while
    they are drawn (one :class:`DiskFullError` line) leaves the measured figures on disk."""
    report["engine"] = (f"torch {torch.__version__} (transformers), {torch.get_num_threads()} CPU threads"
                        if not torch.cuda.is_available() else f"torch {torch.__version__} (transformers), CUDA")
    report["hardware"] = hardware()  # the host kind every speed figure depends on
    report_path = run_dir / REPORT_JSON
    write_json_atomic(report_path, {**report, "plots": []})
    plots = write_report_plots(report, run_dir, training_metrics=distill_dir / "checkpoints" / "metrics.jsonl")
    report["plots"] = [str(p) for p in plots]
    write_json_atomic(report_path, report)
    _log_report(cfg, run_dir, report, plots)
    write_report_markdown(report, run_dir / REPORT_MD)
    return report_path


def _training_completions(cfg: Config, trained_on: Path) -> list[list[int]]:
    """The target's training answers of the generate run the drafter was distilled on (token ids), which
    ``evaluate.compare_vocab_sizes`` picks its heads from; empty when none are asked for."""
    if not cfg.evaluate.compare_vocab_sizes:
        return []
    dataset = load_generated(trained_on)[0]
    return list(dataset.select_columns(["completion_ids"])["completion_ids"])


def _evaluation_set(cfg: Config, prompts: list, distill_dir: Path, gen_dir: Path, trained_on: Path) -> dict[str, Any]:
    """Where the prompts come from, and how many of them were in this drafter's training data (warned)."""
    eval_set = {"source": str(cfg.evaluate.prompts) if cfg.evaluate.prompts else "held-out",
                **({} if cfg.evaluate.prompts or gen_dir == trained_on else {"generate": str(gen_dir)})}
    # held-out prompts of another generate run (inputs.generate) may have been training prompts of this drafter
    eval_set["seen_in_training"] = prompts_seen_in_training([p[2] for p in prompts], distill_dir)
    if eval_set["seen_in_training"]:
        print(f"evaluate: warning: {eval_set['seen_in_training']} of the {len(prompts)} prompts of "
              f"{cfg.evaluate.prompts or gen_dir} were in the data this drafter was distilled on: their figures "
              "flatter it (evaluate the generate run it was trained on, or name unseen prompts: evaluate.prompts=)")
    return eval_set


def _reference_drafters(cfg: Config, info: dict[str, Any], tuned, tokenizer, train_completions,
                        as_runner) -> dict[str, Any]:
    """The drafters measured beside the tuned one ``tuned``, each turned into its runner by ``as_runner`` as soon
    as it is loaded: ``undistilled`` (``evaluate.baseline``; the same reduced head as the tuned one, if any), then
    by name ``evaluate.compare_drafters`` with, under ``evaluate.stock_drafter``, the stock base model when the
    tuned drafter is cut from it or has a reduced head, then ``evaluate.compare_vocab_sizes``' reduced heads.
    Loaded before the long runs, so that a bad drafter config fails first.

    Raises:
        TokenizerMismatchError: a drafter's tokenizer does not match the target's.
    """
    drafters = {}
    draft_vocab = draft_vocabulary_of(tuned)
    if cfg.evaluate.baseline:  # loaded first: a bad drafter config fails before the long runs
        # the drafter this run started from (its drafter_info), not whatever drafter.* says now
        print("evaluate: loading the undistilled drafter (the one distill started from)", flush=True)
        base, base_tok, _ = initial_drafter(_as_distilled(cfg, info), dtype=cfg.drafter.dtype)
        check_tokenizers(tokenizer, base_tok, cfg.target.name, cfg.drafter.name)
        if draft_vocab is not None:
            # the same reduced head (rows of the untrained head): before vs after differs by training alone
            reduce_vocabulary(base, draft_vocab.clone())
        drafters["undistilled"] = as_runner(base.eval())
        del base
    names = list(cfg.evaluate.compare_drafters)
    stock = info.get("base_name") or cfg.drafter.name
    cut = info.get("init", "sibling") != "sibling" or draft_vocab is not None
    if cfg.evaluate.stock_drafter and cut and stock not in names:
        names.append(stock)  # the reference of every against_stock figure
    for name in names:  # loaded up front too, for the same reason
        print(f"evaluate: loading {name}" + (" (the stock drafter)" if name == stock else ""), flush=True)
        other, other_tok, _ = load_model(name, dtype=cfg.drafter.dtype)
        check_tokenizers(tokenizer, other_tok, cfg.target.name, name)
        drafters[name] = as_runner(other)
        del other
    drafters.update(_reduced_stock_drafters(cfg, stock, tokenizer, train_completions, as_runner))
    return drafters


def _checkpoint_drafters(cfg: Config, distill_dir: Path, info: dict[str, Any], draft_vocab,
                         as_runner) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """``evaluate.checkpoints``: every ``checkpoint-<step>`` the distill run kept before its last step (that one
    is the distilled drafter), built as the run built it, as ``as_runner`` makes it, keyed by folder name; and
    each one's ``{"step", "tokens_seen", "examples_seen"}``. Nothing when the setting is off."""
    if not cfg.evaluate.checkpoints:
        return {}, {}
    final_step = (read_manifest(distill_dir).get("train") or {}).get("steps")
    found = budget_checkpoints(distill_dir / CHECKPOINTS, final_step)
    if not found:
        warn_no_checkpoints(distill_dir)
    runners, tokens = {}, {}
    for _, path in found:
        print(f"evaluate: loading {path.name} of the distill run (evaluate.checkpoints)", flush=True)
        base, _, _ = initial_drafter(_as_distilled(cfg, info), dtype=cfg.drafter.dtype)
        if draft_vocab is not None:  # the head the run trained with: the checkpoint's weights fit it
            reduce_vocabulary(base, draft_vocab.clone())
        runners[path.name] = as_runner(trained_drafter_at(base, path).eval())
        tokens[path.name] = checkpoint_tokens(path)
    return runners, tokens


def _share_costs(costs: dict[str, Any], source: str, names: list[str]) -> None:
    """Give each of ``names`` (drafters of ``source``'s shapes, not timed themselves) ``source``'s entry in every
    per-drafter table of ``costs`` (:func:`decode.costs.measure_cost_ratios`), and a place in its pooled group."""
    if not names:
        return
    for table in costs.values():
        if isinstance(table, dict) and source in table:
            table.update({name: table[source] for name in names})
    groups = costs.setdefault("pooled", [])
    group = next((g for g in groups if source in g), None)
    if group is None:
        groups.append([source, *names])
    else:
        group.extend(names)


def reduced_head_name(stock: str, size: int) -> str:
    """The report's key of the stock drafter with an untrained ``size``-token head."""
    return f"{stock} ({size // 1000}k head)" if size % 1000 == 0 else f"{stock} ({size}-token head)"


def _reduced_stock_drafters(cfg: Config, stock: str, tokenizer, train_completions, as_runner) -> dict[str, Any]:
    """``evaluate.compare_vocab_sizes``: the stock drafter with its head cut to each size's most frequent tokens
    of ``train_completions`` (EOS and pad always kept, as distill keeps them), untrained, as ``as_runner`` makes
    it.

    Raises:
        ConfigError: a size larger than the vocabulary.
    """
    reduced = {}
    for size in cfg.evaluate.compare_vocab_sizes:
        print(f"evaluate: loading the stock drafter with its head cut to {size:,} tokens", flush=True)
        model, model_tok, _ = load_model(stock, dtype=cfg.drafter.dtype)
        check_tokenizers(tokenizer, model_tok, cfg.target.name, stock)
        print(f"evaluate: cutting its head to the {size:,} tokens most frequent in the training answers, and "
              "preparing it to run", flush=True)
        try:
            reduce_for_training(model, size, train_completions, always=eos_token_ids(model, tokenizer))
        except ValueError as err:
            raise ConfigError(f"evaluate.compare_vocab_sizes: {err}; give sizes below it, or "
                              "evaluate.compare_vocab_sizes=[] to measure no cut head") from err
        reduced[reduced_head_name(stock, size)] = as_runner(model.eval())
        del model
    return reduced


def _add_notes(cfg: Config, report: dict[str, Any], quantization: str, busy: float | None,
               gen_manifest: dict[str, Any]) -> None:
    """The report's notes: what its figures mean, and what may have made them lower or noisier."""
    report["notes"] = [
        "mean_accepted_tokens: tokens emitted per target forward = accepted draft tokens + 1 "
        "(the target's correction or bonus token)",
        "speedup: decode tokens/s of speculative decoding over the target alone on the same prompts; "
        "prompt prefill excluded",
        f"drafter run as {quantization} by the decoder (decode.drafter_quantization); HF assisted generation "
        f"gets the same drafter module; the output is the target's either way",
        *report.get("notes", []),
    ]
    report["cpu_busy_before"] = busy  # share of the CPUs other processes used just before measuring
    if busy is not None and busy > 0.25 and not torch.cuda.is_available():
        report["notes"].append(
            f"the machine was busy when the measurement started (other processes used {busy:.0%} of the "
            f"{os.cpu_count()} CPUs): they compete with the model threads, so tokens/s and speedups are lower and "
            f"noisier than on an idle machine; re-run evaluate when it is idle")
    skipped = gen_manifest.get("skipped_prompt_lines") or []
    # who wrote the training answers (the target, or a dataset it scored) and how many answer tokens there were
    report["data"] = {"skipped_prompt_lines": len(skipped), "answers": gen_manifest.get("answers", "target"),
                      "training_answer_tokens": gen_manifest.get("completion_tokens")}
    if skipped:
        report["notes"].append(f"{len(skipped)} malformed prompt line(s) were skipped by generate "
                               f"(data.on_bad_line=skip): {'; '.join(skipped[:5])}")
    if report.get("outputs_match_target") is False and cfg.target.dtype != "float32":
        report["notes"].append(
            f"greedy outputs differ from the target alone on some prompts (identical_token_fraction "
            f"{report['identical_token_fraction']:.3f}, first_divergence per prompt in per_prompt): in "
            f"{cfg.target.dtype} the target's verification forward over K+1 tokens rounds differently from "
            f"one-token decoding, so a near-tie between two tokens can flip; transformers' assisted generation "
            f"shows the same. Exactness holds in float32 (target.dtype=float32; tested)")


def _add_distill_validation(report: dict[str, Any], distill_manifest: dict[str, Any]) -> None:
    """The training-time validation figures beside the decoder's, to judge how well they predict acceptance."""
    train = distill_manifest.get("train") or {}
    if "val_expected_acceptance_after" in train:
        # the training-time metric beside the decoder's measurement, to judge how well it predicts acceptance
        report["distill_validation"] = {k: train.get(k) for k in (
            "val_expected_acceptance_before", "val_expected_acceptance_after", "val_loss_before", "val_loss_after",
            "val_top1_agreement_before", "val_top1_agreement_after", "val_simulated_tau_before",
            "val_simulated_tau_after", "val_simulated_draft_length", "stored_top_k")}
