"""evaluate for an EAGLE-3 head: the head beside the stock sibling drafter and prompt lookup, on the same
held-out prompts, with the same figures as a sibling's evaluate.

Exact acceptance from one teacher-forced target pass per prompt (the head unrolled at every block start,
``decode.eagle3.simulation``; the sibling's ``decode.acceptance``), c of both timed side by side in the same
interleaved rounds (the head's one-entry step, ``decode.eagle3.step_model``), the target's verification costs,
predicted speedups at each drafter's best K with paired intervals, per category; then the timed prompts decoded
for real (target alone, the head, the sibling) with the outputs compared and the head's blocks checked against
its simulation. ``distill.stages.evaluate`` hands over here when the distill run holds a head.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from decode.acceptance import MAX_SIMULATED_K
from decode.benchmark import run_target_alone
from decode.costs import measure_cost_ratios, timed_verify_costs
from decode.cpu_linear import use_onednn_linear
from decode.eagle3.decoding import eagle3_generate
from decode.eagle3.head import Eagle3Head
from decode.eagle3.simulation import head_teacher_forced
from decode.eagle3.step_model import HeadStepModel
from decode.quantization import drafter_for_decoding, resolve_quantization
from decode.speculative import speculative_generate
from distill.config import Config
from distill.data.prompts import Prompt, encode_prompt
from distill.drafters.setup import DRAFTER_DIR, DRAFTER_INFO
from distill.errors import DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.hardware import hardware
from distill.measure.report import REPORT_JSON, REPORT_MD, write_budget_plot
from distill.measure.simulation import (
    answer_all,
    answers_target_key,
    paired_against,
    pairing_of,
    prompt_lookup_section,
    settings_of,
    simulated_drafter,
    teacher_forced,
)
from distill.measure.budget import budget_curve, budget_curve_lines, warn_no_checkpoints
from distill.models.loading import eos_token_ids, load_model
from distill.runs import StageRun, read_manifest
from distill.training.checkpoint import budget_checkpoints, checkpoint_tokens
from distill.training.resume import CHECKPOINTS

DRAFTERS = ("eagle3", "stock")


def is_head_run(distill_dir: Path) -> bool:
    """Whether the distill run ``distill_dir`` trained an EAGLE-3 head."""
    info = distill_dir / DRAFTER_DIR / DRAFTER_INFO
    return info.is_file() and json.loads(info.read_text()).get("kind") == "eagle3"


def run_head_evaluate(cfg: Config, run: StageRun, distill_dir: Path, held_out: list[Prompt], gen_dir: Path) -> Path:
    """Measure the head of ``distill_dir`` and the stock ``drafter.name`` on ``held_out``; writes ``report.json``
    and ``report.md`` into ``run``'s folder and returns the report's path.

    Raises:
        DraftsmithError: the head was trained for another target than ``target.name``.
    """
    info = json.loads((distill_dir / DRAFTER_DIR / DRAFTER_INFO).read_text())
    start = time.perf_counter()
    target, tokenizer, target_res = load_model(cfg.target.name, dtype=cfg.target.dtype)
    if info["target_fingerprint"] != target_res.fingerprint:
        raise DraftsmithError(f"the head in {distill_dir} was trained for {info['target_name']!r}, not for "
                              f"target {cfg.target.name!r}: set target.name={info['target_name']}")
    quantization = resolve_quantization(cfg.decode.drafter_quantization, target.device)
    # the head stays float32: as int8 (per-token activation scales) its incremental and whole-sequence forwards
    # part at near-ties often enough that the simulation would not be the decoder's (2 of 3 real prompts)
    checkpoints = _checkpoint_heads(cfg, distill_dir)
    runners = {"eagle3": Eagle3Head.load(distill_dir / DRAFTER_DIR).to(target.device),
               **{name: head.to(target.device) for name, (head, _) in checkpoints.items()},
               "stock": drafter_for_decoding(load_model(cfg.drafter.name, dtype="float32")[0], quantization,
                                             inplace=True)}
    use_onednn_linear(target)
    eos = eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts = [(p.id, p.category, encode_prompt(tokenizer, p)) for p in held_out]
    timed = prompts[: cfg.evaluate.timed_prompts]
    load_s = time.perf_counter() - start
    print(f"evaluate: the target's answers to all {len(prompts)} held-out prompts, for the exact acceptance")
    answers = answer_all(target, prompts, cfg.decode, eos=eos, pad_id=pad, batch_size=cfg.generate.batch_size,
                         batch_tokens=cfg.generate.batch_tokens, seed=cfg.evaluate.seed,
                         cache_dir=Path(cfg.outputs) / ".shards", look_in=(gen_dir,),
                         target_key=answers_target_key(target_res.fingerprint, cfg.target.dtype, target),
                         tokenizer=tokenizer)
    samples = _samples(cfg, target, runners, prompts, answers)
    costs = _costs(cfg, target, runners, timed)
    report = _simulated(cfg, samples, costs, prompts, answers)
    if checkpoints:
        report["budget_curve"] = _head_budget_curve(report, {n: t for n, (_, t) in checkpoints.items()},
                                                    read_manifest(distill_dir).get("train") or {})
    report["timed"] = _timed(cfg, target, runners, timed, report, eos, tokenizer)
    report["simulation_check"] = _simulation_check(report["timed"], samples["eagle3"][: len(timed)],
                                                   cfg.decode.max_new_tokens)
    report.update({"kind": "eagle3", "target": {"name": cfg.target.name, "fingerprint": target_res.fingerprint,
                                                "dtype": str(next(target.parameters()).dtype)},
                   "drafter": {**info, "path": str(distill_dir / DRAFTER_DIR)}, "stock_drafter": cfg.drafter.name,
                   "drafter_quantization": quantization, "head_precision": "float32", "host": hardware(), "prompt_ids": [p[0] for p in prompts],
                   "side_by_side_costs": costs, "model_load_s": round(load_s, 1)})
    path = run.path / REPORT_JSON
    write_json_atomic(path, report)
    write_text_atomic(run.path / REPORT_MD, head_report_markdown(report))
    write_budget_plot(report, run.path)
    run.complete(artifacts=(REPORT_JSON,), report=str(path))
    return path


def _samples(cfg: Config, target, runners: dict, prompts: list, answers: list[list[int]]) -> dict[str, list]:
    """Each drafter's teacher-forced samples over the target's answers (betas too when sampling)."""
    tokens = sum(map(len, answers))
    d = cfg.decode
    sampling = dict(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p) if d.temperature > 0 else None
    print(f"evaluate: the EAGLE-3 head unrolled {MAX_SIMULATED_K} steps at every block start of the {tokens} answer "
          f"tokens, then the stock drafter teacher-forced over them")
    from tqdm.auto import tqdm

    samples = {}
    for key in _heads(runners):
        samples[key] = [head_teacher_forced(target, runners[key], pid, category, ids, answer, sampling=sampling)
                        for (pid, category, ids), answer in tqdm(list(zip(prompts, answers)), unit="prompt",
                                                                 desc=f"{_label(key)}, teacher-forced")]
    vocab = target.config.get_text_config().vocab_size
    samples["stock"] = teacher_forced(target, runners["stock"], prompts, answers, d, vocab)
    return samples


def _heads(runners: dict) -> list[str]:
    """The head keys of ``runners``: the final head, then its checkpoints by step."""
    return [key for key in runners if key != "stock"]


def _label(key: str) -> str:
    return "EAGLE-3 head" if key == "eagle3" else f"EAGLE-3 head {key}"


def _checkpoint_heads(cfg: Config, distill_dir: Path) -> dict[str, tuple[Eagle3Head, dict[str, int]]]:
    """``evaluate.checkpoints``: every ``checkpoint-<step>`` head the distill run kept before its last step,
    keyed by folder name, with its ``{"step", "tokens_seen", "examples_seen"}``; {} when the setting is off."""
    if not cfg.evaluate.checkpoints:
        return {}
    final_step = (read_manifest(distill_dir).get("train") or {}).get("steps")
    found = budget_checkpoints(distill_dir / CHECKPOINTS, final_step)
    if not found:
        warn_no_checkpoints(distill_dir)
    return {path.name: (Eagle3Head.load(path), checkpoint_tokens(path)) for _, path in found}


def _costs(cfg: Config, target, runners: dict, timed: list) -> dict[str, Any]:
    """c of the head's step and of the stock drafter in the same interleaved rounds, and the target's
    verification costs for K + 1 = 1..17 tokens with their rounds."""
    ids = [p for _, _, p in timed[:3]]
    print(f"evaluate: c of the head and of the stock drafter, timed side by side on {len(ids)} prompts")
    models = {"eagle3": HeadStepModel(runners["eagle3"], target.get_input_embeddings()), "stock": runners["stock"]}
    costs = measure_cost_ratios(target, models, ids, seed=cfg.evaluate.seed)
    verify, measured, rounds = timed_verify_costs(target, ids, MAX_SIMULATED_K + 1, rounds=5)
    return {**costs, "verify_costs": verify, "verify_costs_measured": measured, "verify_cost_rounds": rounds}


def _model_costs(costs: dict[str, Any], key: str) -> dict[str, Any]:
    return {"cost_ratio": costs["cost_ratios"][key], "cost_ratio_rounds": costs["cost_ratio_rounds"][key],
            "verify_costs": costs["verify_costs"], "verify_cost_rounds": costs["verify_cost_rounds"]}


def _simulated(cfg: Config, samples: dict[str, list], costs: dict, prompts: list, answers: list) -> dict[str, Any]:
    """Each drafter's ``simulated`` section, the head against the stock drafter (paired), and prompt lookup."""
    settings = settings_of(cfg.decode, {})
    report: dict[str, Any] = {"drafters": {}}
    pairings = {}
    for key in samples:
        timed_as = "stock" if key == "stock" else "eagle3"  # a checkpoint has the final head's shapes and c
        section, totals = simulated_drafter(samples[key], settings, _model_costs(costs, timed_as), cfg.evaluate.seed)
        section["cost_ratio"] = costs["cost_ratios"][timed_as]
        report["drafters"][key] = {"simulated": section}
        pairings[key] = pairing_of(samples[key], settings, section, totals, _model_costs(costs, timed_as))
    for key in samples:
        if key != "stock":
            report["drafters"][key]["against_stock"] = paired_against(pairings[key], pairings["stock"],
                                                                      cfg.evaluate.seed)
    report["against_stock"] = report["drafters"]["eagle3"]["against_stock"]
    if cfg.evaluate.prompt_lookup and not settings.sampling:
        report["prompt_lookup"] = prompt_lookup_section(prompts, answers, settings, costs["verify_costs"],
                                                        cfg.evaluate.seed)
    return report


def _timed(cfg: Config, target, runners: dict, timed: list, report: dict, eos: list[int], tokenizer) -> dict:
    """The timed prompts decoded for real: the target alone, the head and the stock drafter, each at the K its
    simulation recommends; tokens/s, speedups and whether each output equals the target's."""
    d = cfg.decode
    print(f"evaluate: the target alone, the head and the stock drafter decoding {len(timed)} prompts, timed")
    alone = run_target_alone(target, timed, max_new_tokens=d.max_new_tokens, eos_token_ids=eos,
                             temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, seed=cfg.evaluate.seed,
                             engine="loop", tokenizer=tokenizer)
    result = {"num_prompts": len(timed), "target_tokens_per_s": _rate(alone)}
    for key in DRAFTERS:
        k = report["drafters"][key]["simulated"].get("recommended_draft_length") or d.draft_length
        outputs = []
        for (_, _, ids), reference in zip(timed, alone):
            generator = torch.Generator(device=target.device).manual_seed(cfg.evaluate.seed)
            args = dict(draft_length=k, max_new_tokens=d.max_new_tokens, eos_token_ids=eos, temperature=d.temperature,
                        top_k=d.top_k, top_p=d.top_p, generator=generator)
            prompt = torch.tensor([ids], device=target.device)
            if key == "eagle3":
                outputs.append(eagle3_generate(target, runners[key], prompt, **args))
            else:
                outputs.append(speculative_generate(target, runners[key], prompt, **args))
        rate = _rate(outputs)
        same = sum(o.new_tokens.tolist() == r.new_tokens.tolist() for o, r in zip(outputs, alone))
        result[key] = {"draft_length": k, "tokens_per_s": rate, "speedup": rate / result["target_tokens_per_s"],
                       "outputs_equal_target": same, "accepted_per_block": [o.stats.accepted_per_block
                                                                             for o in outputs]}
    return result


def _rate(outputs) -> float:
    tokens = sum(o.stats.new_tokens for o in outputs)
    return tokens / max(sum(o.stats.decode_s for o in outputs), 1e-9)


def _simulation_check(timed: dict, samples: list, max_new_tokens: int) -> dict[str, Any]:
    """Whether the head's decoded blocks on the timed prompts are the simulated ones: exact in float32 (tests),
    up to near-ties between the whole-sequence and the incremental forwards, which an int8 head's per-token
    activation scales and a weak head's small margins make more frequent. Also the first block that differs per
    prompt (None: equal) and the tau of both, so a difference is sized, not only counted."""
    k = timed["eagle3"]["draft_length"]
    matches, first, decoded_blocks, simulated_blocks, tokens = 0, [], 0, 0, 0
    for blocks, sample in zip(timed["eagle3"]["accepted_per_block"], samples):
        simulated = sample.greedy_blocks(draft_length=k, max_new_tokens=max_new_tokens).accepted_per_block
        matches += simulated == blocks
        first.append(next((i for i, (a, b) in enumerate(zip(simulated, blocks)) if a != b),
                          None if simulated == blocks else min(len(simulated), len(blocks))))
        decoded_blocks, simulated_blocks = decoded_blocks + len(blocks), simulated_blocks + len(simulated)
        tokens += len(sample.answer)
    return {"prompts": len(samples), "blocks_equal": matches, "draft_length": k, "first_difference": first,
            "decoded_tau": tokens / max(decoded_blocks, 1), "simulated_tau": tokens / max(simulated_blocks, 1)}


def head_report_markdown(report: dict[str, Any]) -> str:
    """report.md of a head's evaluate: one table of both drafters, the paired comparison and the timed runs."""
    lines = ["# EAGLE-3 head against the stock drafter", "",
             f"Target {report['target']['name']} ({report['target']['dtype']}), stock drafter "
             f"{report['stock_drafter']} ({report['drafter_quantization']}), the head {report['head_precision']}; "
             f"host: "
             f"{'bf16 matrix units' if report['host'].get('bf16_fast') else 'no bf16 units'} "
             f"({report['host'].get('cpu_capability')}).", "",
             "| drafter | prompts | acceptance (K) | tau | c | best K | predicted speedup at best K |",
             "|---|---|---|---|---|---|---|"]
    for key in report["drafters"]:
        s = report["drafters"][key]["simulated"]
        ci = s["ci95"]
        lines.append(f"| {key} | {s['num_prompts']} | {s['acceptance_rate']:.3f} [{ci['acceptance_rate'][0]:.3f}, "
                     f"{ci['acceptance_rate'][1]:.3f}] ({s['draft_length']}) | {s['mean_accepted_tokens']:.2f} "
                     f"[{ci['mean_accepted_tokens'][0]:.2f}, {ci['mean_accepted_tokens'][1]:.2f}] | "
                     f"{s['cost_ratio']:.3f} | {s.get('recommended_draft_length')} | "
                     f"{_speedup_at_best(s)} |")
    against = report["against_stock"]
    tau = against["tau_difference"]
    lines += ["", f"Head minus stock, tau at K = {report['drafters']['eagle3']['simulated']['draft_length']}: "
              f"{tau['mean_accepted_tokens']:+.3f} [{tau['ci95'][0]:+.3f}, {tau['ci95'][1]:+.3f}] (paired)."]
    ratio = against.get("predicted_speedup_ratio")
    if ratio:
        lines.append(f"Predicted speedup ratio head / stock (each at its best K): {ratio['ratio']:.3f} "
                     f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}] ({ratio['interval_covers']}).")
    timed = report["timed"]
    lines += ["", f"Timed on {timed['num_prompts']} prompts (no interval): target alone "
              f"{timed['target_tokens_per_s']:.2f} tokens/s; " + "; ".join(
                  f"{key} at K = {timed[key]['draft_length']}: {timed[key]['speedup']:.2f}x, output equal to the "
                  f"target's on {timed[key]['outputs_equal_target']}/{timed['num_prompts']}" for key in DRAFTERS) + "."]
    check = report["simulation_check"]
    lines.append(f"Simulated blocks equal to the decoded ones on {check['blocks_equal']}/{check['prompts']} prompts "
                 f"(tau decoded {check['decoded_tau']:.3f}, simulated {check['simulated_tau']:.3f} on them).")
    lines += budget_curve_lines(report)
    return "\n".join(lines) + "\n"


def _head_budget_curve(report: dict[str, Any], checkpoints: dict[str, dict[str, int]],
                       train: dict[str, Any]) -> dict[str, Any]:
    """``budget_curve`` of the head's checkpoints and final head (:func:`distill.measure.budget.budget_curve`),
    the stock sibling drafter as its 0-token point: a head starts from no drafter of its own, so its tau
    differences are against the stock drafter, the reference of every ratio."""
    drafters = report["drafters"]

    def as_section(key: str) -> dict[str, Any]:
        against = drafters[key].get("against_stock") or {}
        return {**drafters[key], "paired_difference": against.get("tau_difference")}

    shaped = {"compared_drafters": {name: as_section(name) for name in checkpoints},
              "baseline_drafter": drafters["stock"], "drafter_stock": "undistilled",
              **as_section("eagle3"), "num_prompts": drafters["eagle3"]["simulated"]["num_prompts"]}
    curve = budget_curve(shaped, checkpoints, {"step": train.get("steps"), "tokens_seen": train.get("tokens_seen", 0)},
                         train.get("tokens_per_s"))
    for point in curve["points"]:
        point["drafter"] = {"undistilled": "stock drafter", "distilled": "final head"}.get(point["drafter"],
                                                                                         point["drafter"])
    curve.update(stock="stock drafter", num_prompts=shaped["num_prompts"],
                 draft_length=drafters["eagle3"]["simulated"].get("draft_length"))
    return curve


def _speedup_at_best(section: dict) -> str:
    best = section.get("recommended_draft_length")
    if best is None:
        return "-"
    value = section["per_k"][str(best)]["predicted_speedup"]
    ci = section["ci95"].get("predicted_speedup_at_best_k") or [float("nan")] * 2
    return f"{value:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"
