"""``draftsmith check``: will this drafter speed up this target, here? Measured in minutes, no training.

The source article's checklist, measured: tokenizer compatibility, the
drafter's top-1 agreement with the target over the next K positions (its
"above 70%" bar), the acceptance rate the bundled decoder actually gets, the
cost ratio c and the verification costs on this machine, tau at every K 1..
``check.max_draft_length`` simulated exactly from the target's answers and one
teacher-forced drafter pass (``decode.acceptance``), and the K of the highest
predicted speedup beside the article's K = accuracy x 5. Writes ``check.json``
and ``check.md``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from decode.acceptance import SimulationSettings, simulated_section
from decode.costs import machine_busy, measure_cost_ratio, measure_verify_costs, monotone_verify_costs
from decode.cpu_linear import use_onednn_linear
from decode.draft_length import DraftLengthChoice, expected_speedup, rule_of_thumb_draft_length
from decode.metrics import DecodeStats, verify_cost_at
from decode.quantization import drafter_for_decoding, resolve_quantization
from decode.speculative import speculative_generate, target_generate
from distill.config import Config
from distill.data.generated import prompt_length_limit
from distill.data.prompts import encode_prompt, load_prompts, split_prompts
from distill.drafters.build import describe_layers
from distill.drafters.setup import check_layers_exist, initial_drafter
from distill.errors import ConfigError, TokenizerMismatchError
from distill.files import write_json_atomic, write_text_atomic
from distill.measure.simulation import teacher_forced_greedy
from distill.models.loading import eos_token_ids, load_model, tokenizers_compatible
from distill.runs import StageRun

CHECK_JSON = "check.json"
CHECK_MD = "check.md"


@torch.inference_mode()
def top1_agreement(target, drafter, prompts: list[list[int]], draft_length: int) -> float:
    """Share of positions 1..K where the drafter's free-running greedy token equals the target's.

    The source article's "drafter accuracy": both models decode K tokens
    greedily from the prompt on their own, compared position by position.
    It under-states acceptance after a first disagreement (the drafter then
    continues from its own prefix, not the target's).
    """
    vocab = min(m.get_output_embeddings().out_features for m in (target, drafter))
    correct = total = 0
    for ids in prompts:
        input_ids = torch.tensor([ids], device=target.device)
        a = target_generate(target, input_ids, max_new_tokens=draft_length, eos_token_ids=[], vocab_size=vocab)
        b = target_generate(drafter, input_ids, max_new_tokens=draft_length, eos_token_ids=[], vocab_size=vocab)
        correct += int((a.new_tokens == b.new_tokens.to(a.new_tokens.device)).sum())
        total += draft_length
    return correct / total


def simulated_choice(simulated: dict[str, Any], cost_ratio: float, verify_costs: list[float],
                     accuracy: float) -> DraftLengthChoice:
    """The recommended K from the simulated tau at every K and the measured costs (no extrapolation)."""
    by_k = {int(k): v["predicted_speedup"] for k, v in simulated["per_k"].items()}
    best = simulated["recommended_draft_length"]
    return DraftLengthChoice(best, by_k, rule_of_thumb_draft_length(accuracy), cost_ratio,
                             {k: verify_cost_at(verify_costs, k) for k in by_k}, by_k[best] > 1.0)


def _verdict(result: dict[str, Any]) -> str:
    choice = result["draft_length_choice"]
    if not choice["speculation_pays"]:
        return ("speculative decoding would slow this pair down on this machine: best expected speedup "
                f"{max(choice['expected_speedup_by_k'].values()):.2f}x; distil the drafter or pick a cheaper one")
    best = choice["best_draft_length"]
    return (f"use K = {best}: expected speedup {choice['expected_speedup_by_k'][best]:.2f}x "
            f"(measured at K = {result['draft_length']}: {result['measured_speedup']:.2f}x)")


def render_check_markdown(result: dict[str, Any]) -> str:
    """The check as a Markdown page."""
    choice = result["draft_length_choice"]
    by_k = choice["expected_speedup_by_k"]
    accuracy_ok = "pass" if result["accuracy_pass"] else "fail"
    lines = [
        "# draftsmith check", "",
        f"Target `{result['target']}`, drafter `{result['drafter']}` (run as {result['drafter_quantization']}), "
        f"{result['num_prompts']} prompts, K = {result['draft_length']}. Engine: {result['engine']}.", "",
        "| check | result |", "|---|---|",
        f"| tokenizers | {'compatible' if result['tokenizers_compatible'] else 'DIFFERENT: ' + result['tokenizer_detail']} |",
        f"| embedding rows (target / drafter) | {result['vocab_rows'][0]} / {result['vocab_rows'][1]} |",
        f"| top-1 agreement over the next {result['draft_length']} tokens | {result['top1_agreement']:.3f} "
        f"({accuracy_ok} at the article's {result['accuracy_threshold']:.0%}) |",
        f"| acceptance rate (bundled decoder, K = {result['draft_length']}) | {result['acceptance_rate']:.3f} |",
        f"| mean accepted tokens per target forward tau | {result['mean_accepted_tokens']:.2f} |",
        f"| cost ratio c (drafter / target forward) | {result['cost_ratio']:.3f} |",
        f"| measured speedup at K = {result['draft_length']} (decode tokens/s vs target alone) | "
        f"{result['measured_speedup']:.2f}x |",
        f"| recommended K (predicted speedup: simulated tau at every K, measured c and verify costs) | "
        f"{choice['best_draft_length']} ({by_k[choice['best_draft_length']]:.2f}x) |",
        f"| article's rule of thumb K = max(2, int(accuracy x 5)) | {choice['rule_of_thumb']} |",
        "", "| K | " + " | ".join(str(k) for k in by_k) + " |", "|---|" + "---|" * len(by_k),
        "| simulated tau | " + " | ".join(f"{v['mean_accepted_tokens']:.2f}" for v in result["simulated"]["per_k"].values())
        + " |",
        "| predicted speedup | " + " | ".join(f"{v:.2f}x" for v in by_k.values()) + " |",
        "", f"**Verdict:** {result['verdict']}", "",
    ]
    return "\n".join(lines)


def _load_pair(cfg: Config, run_dir: Path) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """Load the target and the drafter; ``(target, tokenizer, target resolution, drafter, first result fields)``.

    Raises:
        TokenizerMismatchError: the tokenizers differ (after ``check.json`` records what differs).
    """
    print(f"check: loading target {cfg.target.name} and drafter {cfg.drafter.name}", flush=True)
    target, tokenizer, target_res = load_model(cfg.target.name, dtype=cfg.target.dtype)
    drafter, drafter_tok, _ = initial_drafter(cfg, dtype=cfg.drafter.dtype)
    drafter.eval()
    ok, why = tokenizers_compatible(tokenizer, drafter_tok)
    rows = [m.get_output_embeddings().out_features for m in (target, drafter)]
    result: dict[str, Any] = {
        "target": cfg.target.name, "drafter": cfg.drafter.name if cfg.drafter.init == "sibling"
        else f"{cfg.drafter.name} ({describe_layers(cfg.drafter.num_layers, cfg.drafter.layer_selection, cfg.drafter.layers)})",
        "tokenizers_compatible": ok, "tokenizer_detail": why, "vocab_rows": rows,
    }
    if not ok:
        write_json_atomic(run_dir / CHECK_JSON, result)
        raise TokenizerMismatchError(
            f"target {cfg.target.name!r} and drafter {cfg.drafter.name!r} cannot be paired: {why} "
            f"(written to {run_dir / CHECK_JSON}); pick a drafter from the target's family")
    return target, tokenizer, target_res, drafter, result


def _timed_decoding(target, runner, prompts: list[list[int]], draft_length: int, max_new_tokens: int,
                    eos: list[int], vocab_size: int) -> tuple[list[DecodeStats], list[DecodeStats], list[list[int]]]:
    """Speculative decoding and the target alone on each prompt, after a warm-up of both.

    Returns the per-prompt speculative stats, the target-alone stats and the target's answers (token ids).
    """
    warm_up = torch.tensor([prompts[0]], device=target.device)  # first calls pay one-time kernel setup
    speculative_generate(target, runner, warm_up, draft_length=draft_length, max_new_tokens=draft_length + 2,
                         eos_token_ids=eos)
    target_generate(target, warm_up, max_new_tokens=4, eos_token_ids=eos)
    spec, alone, answers = [], [], []
    for ids in tqdm(prompts, desc="check", unit="prompt"):
        input_ids = torch.tensor([ids], device=target.device)
        spec.append(speculative_generate(target, runner, input_ids, draft_length=draft_length,
                                         max_new_tokens=max_new_tokens, eos_token_ids=eos).stats)
        out = target_generate(target, input_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                              vocab_size=vocab_size)
        alone.append(out.stats)
        answers.append(out.new_tokens.tolist())
    return spec, alone, answers


def run_check(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run the pre-flight check into ``run_dir``; returns the path of ``check.json``.

    Raises:
        TokenizerMismatchError: the tokenizers differ (after ``check.json`` records what differs).
        ConfigError: a bad drafter config, or fewer prompts than ``check.num_prompts`` (within
            ``data.max_prompt_tokens``).
    """
    c = cfg.check
    if cfg.drafter.init == "eagle3":
        raise ConfigError("draftsmith check measures a drafter as it stands, and an EAGLE-3 head has nothing to "
                          "measure before training: train one (draftsmith distill drafter=eagle3), then draftsmith "
                          "evaluate drafter=eagle3 measures it beside the stock drafter")
    check_layers_exist(cfg)
    # the prompts come first (the target's tokenizer is enough): too few is refused before any model loads
    prompts = load_prompts(cfg.data.source, cfg.data.path, sharegpt_turns=cfg.data.mixed_sharegpt)
    _, held_out = split_prompts(prompts, num_train=0,
                                num_eval=c.num_prompts, seed=cfg.data.seed, keep=prompt_length_limit(cfg),
                                counts="check.num_prompts")
    run = StageRun.start("check", run_dir, config_yaml, inputs={})
    target, tokenizer, target_res, drafter, result = _load_pair(cfg, run_dir)
    rows = result["vocab_rows"]
    prompts = [encode_prompt(tokenizer, p) for p in held_out]
    quantization = resolve_quantization(cfg.decode.drafter_quantization, target.device)
    runner = drafter_for_decoding(drafter, quantization)
    use_onednn_linear(target)  # float32 on a CPU: few-token forwards through oneDNN (decode.cpu_linear)
    eos = eos_token_ids(target, tokenizer)
    busy = machine_busy("check")  # prints a warning when other processes hold the CPUs
    start = time.perf_counter()
    print(f"check: top-1 agreement, then speculative decoding vs the target alone on {len(prompts)} prompts x "
          f"{c.max_new_tokens} tokens", flush=True)
    accuracy = top1_agreement(target, drafter, prompts, c.draft_length)
    spec, alone, answers = _timed_decoding(target, runner, prompts, c.draft_length, c.max_new_tokens, eos,
                                           min(rows))
    pooled, target_stats = DecodeStats.merge(spec), DecodeStats.merge(alone)
    cost_ratio = measure_cost_ratio(target, runner, prompts[:2])
    verify_costs = monotone_verify_costs(measure_verify_costs(target, prompts[:2], c.max_draft_length + 1))
    # every K exactly, from the target's own answers and one teacher-forced pass (decode.acceptance)
    samples = teacher_forced_greedy(runner, [(p.id, p.category, ids) for p, ids in zip(held_out, prompts)],
                                    answers, min(rows))
    simulated, _ = simulated_section(samples, SimulationSettings(c.draft_length, c.max_new_tokens),
                                     cost_ratio=cost_ratio, verify_costs=verify_costs, max_k=c.max_draft_length)
    choice = simulated_choice(simulated, cost_ratio, verify_costs, accuracy)
    result.update({
        "num_prompts": len(prompts), "prompt_ids": [p.id for p in held_out], "draft_length": c.draft_length,
        "drafter_quantization": quantization,
        "engine": f"torch {torch.__version__}, " + ("CUDA" if target.device.type == "cuda"
                                                    else f"{torch.get_num_threads()} CPU threads"),
        "top1_agreement": accuracy, "accuracy_threshold": c.accuracy_threshold,
        "accuracy_pass": accuracy >= c.accuracy_threshold,
        "acceptance_rate": pooled.acceptance_rate, "alpha": pooled.alpha,
        "mean_accepted_tokens": pooled.mean_accepted_tokens,
        "per_position_acceptance": pooled.per_position_acceptance,
        "cost_ratio": cost_ratio, "verify_costs": verify_costs,
        "target_tokens_per_s": target_stats.tokens_per_s, "speculative_tokens_per_s": pooled.tokens_per_s,
        "measured_speedup": pooled.tokens_per_s / target_stats.tokens_per_s if target_stats.tokens_per_s else 0.0,
        "expected_speedup_at_measured_k": expected_speedup(pooled.per_position_acceptance, c.draft_length,
                                                           cost_ratio, verify_costs[min(c.draft_length, len(verify_costs) - 1)]),
        "draft_length_choice": asdict(choice), "simulated": simulated,
        "measure_s": time.perf_counter() - start, "cpu_busy_before": busy,
        "target_fingerprint": target_res.fingerprint,
    })
    result["verdict"] = _verdict(result)
    path = run_dir / CHECK_JSON
    write_json_atomic(path, result)
    markdown = render_check_markdown(result)
    write_text_atomic(run_dir / CHECK_MD, markdown)
    print(markdown)
    run.complete(check=str(path), verdict=result["verdict"])
    return path
