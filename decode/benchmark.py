"""Target alone, HF assisted generation and our speculative decoder on the same prompts.

All three run batch size 1 on the same token ids. Speeds are decode-only
(tokens / seconds after the prompt prefill), pooled over prompts
(total new tokens / total decode seconds), and belong to the torch stack
these models run in (a llama.cpp build of the same models behaves differently).

The target-alone baseline is transformers' ``generate`` (``engine="hf"``) or
our own KV-cached loop (``engine="loop"``). HF does not report its prefill, so
its decode seconds are its wall time minus our measured prefill of the same
prompt (an approximation, also used for HF assisted generation).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging as hf_logging

from decode.costs import (
    measure_forward_seconds,
    timed_verify_costs,
)
from decode.draft_length import choose_draft_length
from decode.metrics import DecodeStats, theoretical_speedup
from decode.model_calls import prefill, sync, vocab_size_of
from decode.progress import heartbeat
from decode.speculative import SpeculativeOutput, speculative_generate, target_generate


@dataclass
class _PromptRun:
    prompt_id: str
    category: str
    target: SpeculativeOutput
    speculative: SpeculativeOutput
    hf_tokens: torch.Tensor | None = None
    hf_decode_s: float = 0.0


TARGET_ENGINES = ("hf", "loop")
VERIFY_ROUNDS = 5
"""Timing rounds of the target's verification costs (their median and its bootstrap come from these)."""
MIN_VERIFY_LENGTHS = 8
"""Verification costs are timed for 1..MIN_VERIFY_LENGTHS + 1 tokens at least (K up to 8 needs no extrapolation)."""


def _hf_kwargs(*, max_new_tokens, eos_token_ids, temperature, top_k=0, top_p=1.0, stop_strings=(),
               tokenizer=None) -> dict:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, repetition_penalty=1.0)
    if eos_token_ids:
        kwargs.update(eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0])
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
    else:  # the target's generation_config may hold sampling defaults; greedy ignores them
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if stop_strings:
        kwargs.update(stop_strings=list(stop_strings), tokenizer=tokenizer)
    return kwargs


def _drop_assistant_config_notice(record: logging.LogRecord) -> bool:
    """False for transformers' own notice, raised by its candidate generator calling the assistant's
    ``generate`` with both a generation config and arguments (transformers 5.x): nothing a user can change."""
    return "Passing `generation_config` together with generation-related" not in record.getMessage()


hf_logging.get_logger("transformers.generation.utils").addFilter(_drop_assistant_config_notice)


@torch.inference_mode()
def _hf_target_generate(target, input_ids, **decode_args) -> tuple[torch.Tensor, float]:
    """The target alone through transformers' ``generate``; returns (new tokens, wall seconds)."""
    sync(target.device)
    start = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **_hf_kwargs(**decode_args))
    sync(target.device)
    return output[0, input_ids.shape[1]:], time.perf_counter() - start


@torch.inference_mode()  # as inside generate: with autograd recording, a float32 CPU prefill costs ~3x
def _prefill_seconds(model, input_ids) -> float:
    sync(model.device)
    start = time.perf_counter()
    prefill(model, input_ids)
    sync(model.device)
    return time.perf_counter() - start


def _hf_assisted_generate(target, drafter, input_ids, *, draft_length=None, schedule="constant",
                          confidence_threshold=0.0, **decode_args) -> tuple[torch.Tensor, float]:
    """HF assisted generation; returns (new tokens, wall seconds).

    With ``draft_length`` our draft-length settings are passed; None leaves transformers' defaults.
    """
    # The candidate generator reads these from the *assistant's* generation config; the "heuristic"
    # schedule and the confidence-threshold tuning write back there between calls, so it is restored.
    saved = copy.deepcopy(drafter.generation_config)
    assisted = {} if draft_length is None else dict(
        num_assistant_tokens=draft_length, num_assistant_tokens_schedule=schedule,
        assistant_confidence_threshold=confidence_threshold)  # 0 disables early draft stopping
    for key, value in assisted.items():
        setattr(drafter.generation_config, key, value)
    kwargs = _hf_kwargs(**decode_args)
    if "stop_strings" in kwargs:
        # transformers 5.24 forwards `stop_strings` to the assistant's generate without the tokenizer,
        # which then raises; a stopping criterion applies to the target's output only.
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [StopStringCriteria(kwargs.pop("tokenizer"), kwargs.pop("stop_strings"))])
    try:
        sync(target.device)
        start = time.perf_counter()
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter,
                                 **assisted, **kwargs)
        sync(target.device)
        seconds = time.perf_counter() - start
    finally:
        drafter.generation_config = saved
    return output[0, input_ids.shape[1]:], seconds


def hf_assisted_defaults(target, drafter, prompts: list[tuple[str, str, list[int]]], *, max_new_tokens: int,
                         eos_token_ids: Sequence[int], progress: bool = True) -> dict:
    """transformers' assisted generation as a user gets it: ``generate(assistant_model=drafter)``, greedy.

    transformers 5 defaults: 20 draft tokens, constant schedule, confidence threshold 0.4 (tuned on
    the fly from a ROC curve when scikit-learn is installed). Decode seconds = wall time minus our
    measured prefill of both models, as for the other HF figures.

    Returns:
        ``tokens_per_s``, ``new_tokens``, ``decode_s`` pooled over prompts, and the settings used.
    """
    args = dict(eos_token_ids=eos_token_ids, temperature=0.0)
    tokens, seconds = 0, 0.0
    _hf_assisted_generate(target, drafter, torch.tensor([prompts[0][2]], device=target.device),
                          max_new_tokens=4, **args)  # warm-up
    bar = tqdm(prompts, desc="HF assisted (defaults)", unit="prompt", disable=not progress)
    with heartbeat(bar, target=target):
        for _, _, ids in bar:
            input_ids = torch.tensor([list(ids)], device=target.device)
            prefill_s = _prefill_seconds(target, input_ids) + _prefill_seconds(drafter, input_ids)
            new, wall_s = _hf_assisted_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens, **args)
            tokens += len(new)
            seconds += max(wall_s - prefill_s, 1e-9)
    return {"tokens_per_s": tokens / seconds, "new_tokens": tokens, "decode_s": seconds,
            "settings": "transformers defaults: num_assistant_tokens=20, constant, assistant_confidence_threshold=0.4"}


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first position where token sequences ``a`` and ``b`` differ (a length difference counts); None if equal."""
    a, b = a.tolist(), b.tolist()
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _speed_figures(runs: list[_PromptRun], draft_length: int, cost_ratio: float, greedy: bool,
             verify_costs: Sequence[float] | None = None, target_engine: str = "hf",
             target_forward_s: float | None = None) -> dict:
    target = DecodeStats.merge([r.target.stats for r in runs])
    spec = DecodeStats.merge([r.speculative.stats for r in runs])
    mean_k = spec.mean_draft_length
    # Thm 3.8 at the K actually drafted (the mean, for adaptive schedules)
    k_theory = max(1, round(mean_k)) if mean_k else draft_length
    theory = theoretical_speedup(spec.alpha, k_theory, cost_ratio)
    speedup = spec.tokens_per_s / target.tokens_per_s if target.tokens_per_s else 0.0
    figures = {
        "num_prompts": len(runs),
        "draft_length": draft_length,
        "mean_draft_length": mean_k,
        "new_tokens": spec.new_tokens,
        "acceptance_rate": spec.acceptance_rate,
        "alpha": spec.alpha,
        "mean_accepted_tokens": spec.mean_accepted_tokens,
        "per_position_acceptance": spec.per_position_acceptance,
        "target_tokens_per_s": target.tokens_per_s,
        "speculative_tokens_per_s": spec.tokens_per_s,
        "speedup": speedup,
        "cost_ratio": cost_ratio,
        "theoretical_speedup": theory,
        "measured_over_theoretical": speedup / theory if theory else 0.0,
        "outputs_match_target": (all(torch.equal(r.speculative.new_tokens, r.target.new_tokens) for r in runs)
                                 if greedy else None),
        # greedy: share of the target's tokens reproduced before the first divergence (1.0 = identical)
        "identical_token_fraction": (sum(_agreeing_prefix(r) for r in runs) / max(1, sum(len(r.target.new_tokens) for r in runs))
                                     if greedy else None),
        "baselines": {
            "target": {"engine": "transformers generate" if target_engine == "hf" else "draftsmith loop",
                       "tokens_per_s": target.tokens_per_s, "new_tokens": target.new_tokens,
                       "decode_s": target.decode_s, "prefill_s": target.prefill_s},
            "hf_assisted": None,
        },
    }
    if verify_costs:
        # the same formula with the measured cost of verifying K + 1 tokens (not free on a CPU)
        verify = verify_costs[min(k_theory, len(verify_costs) - 1)]
        figures["verify_cost"] = verify
        figures["cost_model_speedup"] = spec.mean_accepted_tokens / (mean_k * cost_ratio + verify) if mean_k else 0.0
        if target_forward_s and spec.accepted_per_block:
            figures["block_seconds"] = block_seconds(spec, cost_ratio, verify, target_forward_s)
            figures["measured_over_cost_model"] = figures["block_seconds"]["measured_over_cost_model"]
        choice = choose_draft_length(spec.per_position_acceptance, cost_ratio, accuracy=spec.acceptance_rate,
                                     verify_costs=verify_costs, max_k=max(8, len(verify_costs) - 1))
        measured = sum(a is not None for a in spec.per_position_acceptance)
        figures["draft_length_choice"] = {**asdict(choice), "measured_positions": measured}
    if all(r.hf_tokens is not None for r in runs):
        hf_tokens = sum(len(r.hf_tokens) for r in runs)
        hf_decode_s = sum(r.hf_decode_s for r in runs)
        hf_tokens_per_s = hf_tokens / hf_decode_s if hf_decode_s > 0 else 0.0
        figures["baselines"]["hf_assisted"] = {
            "tokens_per_s": hf_tokens_per_s,
            "new_tokens": hf_tokens,
            "decode_s": hf_decode_s,
            "speedup": hf_tokens_per_s / target.tokens_per_s if target.tokens_per_s else 0.0,
            "ours_over_hf": spec.tokens_per_s / hf_tokens_per_s if hf_tokens_per_s else 0.0,
            "outputs_match_target": (all(torch.equal(r.hf_tokens.to(r.target.new_tokens.device),
                                                     r.target.new_tokens) for r in runs)
                                     if greedy else None),
        }
    return figures


def block_seconds(spec: DecodeStats, cost_ratio: float, verify_cost: float, target_forward_s: float) -> dict:
    """One speculative block's seconds, measured against the cost model of its forwards timed alone.

    ``draft`` = mean K x c x t, ``verify`` = verify_cost(K) x t, with t the target's 1-token forward
    (seconds) and c, verify_cost measured on the same host; ``measured`` = decode seconds / blocks;
    ``overhead`` = measured - draft - verify: what the loop spends outside those forwards (cache crops,
    host syncs, logits processing, or forwards slower inside the loop than alone).
    ``measured_over_cost_model`` near 1 means the loop costs what its forwards cost.
    """
    blocks = len(spec.accepted_per_block)
    draft = spec.mean_draft_length * cost_ratio * target_forward_s
    verify = verify_cost * target_forward_s
    measured = spec.decode_s / blocks
    return {"measured": measured, "draft": draft, "verify": verify, "overhead": measured - draft - verify,
            "measured_over_cost_model": measured / (draft + verify) if draft + verify > 0 else 0.0}


def _agreeing_prefix(run: _PromptRun) -> int:
    divergence = first_divergence(run.speculative.new_tokens, run.target.new_tokens)
    return len(run.target.new_tokens) if divergence is None else divergence


def run_target_alone(target, prompts: list[tuple[str, str, list[int]]], *, max_new_tokens: int,
                     eos_token_ids: Sequence[int], temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0, vocab_size: int | None = None, engine: str = "hf",
                     stop_strings: Sequence[str] = (), tokenizer=None,
                     progress: bool = True) -> list[SpeculativeOutput]:
    """The target decoding alone on each prompt, for :func:`benchmark`'s ``target_outputs``.

    Args:
        prompts: ``(prompt_id, category, token ids)`` triples.
        engine: ``hf`` = transformers ``generate`` (the reference users compare against;
            decode seconds = wall time minus a separately measured prefill), ``loop`` = our
            KV-cached loop (``decode.speculative.target_generate``, exact decode timing).
        vocab_size: (``loop`` only) sample over the first ``vocab_size`` logits, the
            vocabulary shared with the drafters; transformers samples over the full one.
        stop_strings, tokenizer: stop texts, as in ``speculative_generate``.
    Returns:
        one :class:`SpeculativeOutput` per prompt, with decode-only timings in its stats.
    Raises:
        ValueError: unknown engine or no prompts.
    """
    if engine not in TARGET_ENGINES:
        raise ValueError(f"unknown target engine {engine!r}: choose one of {', '.join(TARGET_ENGINES)}")
    if not prompts:
        raise ValueError("run_target_alone needs at least one prompt")
    device = target.device
    decode_args = dict(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_strings=stop_strings, tokenizer=tokenizer)

    def decode_one(ids: Sequence[int], max_tokens: int) -> SpeculativeOutput:
        input_ids = torch.tensor([list(ids)], device=device)
        args = {**decode_args, "max_new_tokens": max_tokens}
        if engine == "loop":
            return target_generate(target, input_ids, **args, vocab_size=vocab_size,
                                   generator=torch.Generator(device=device).manual_seed(seed))
        if temperature > 0:
            torch.manual_seed(seed)  # transformers samples from torch's global generator
        prefill_s = _prefill_seconds(target, input_ids)
        tokens, wall_s = _hf_target_generate(target, input_ids, **args)
        stats = DecodeStats(draft_length=0, target_forwards=len(tokens), new_tokens=len(tokens),
                            prefill_s=prefill_s, decode_s=max(wall_s - prefill_s, 1e-9),
                            accepted_per_block=[0] * len(tokens), drafted_per_block=[0] * len(tokens))
        return SpeculativeOutput(tokens, stats)

    decode_one(prompts[0][2], min(4, max_new_tokens))  # warm-up
    bar = tqdm(prompts, desc=f"target alone ({engine})", unit="prompt", disable=not progress)
    with heartbeat(bar, target=target):
        return [decode_one(ids, max_new_tokens) for _, _, ids in bar]


def benchmark(
    target,
    drafter,
    prompts: list[tuple[str, str, list[int]]],
    *,
    draft_length: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    schedule: str = "constant",
    max_draft_length: int | None = None,
    confidence_threshold: float = 0.0,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    hf_assisted: bool = True,
    hf_drafter=None,
    target_engine: str = "hf",
    progress: bool = True,
    seed: int = 0,
    target_outputs: Sequence[SpeculativeOutput] | None = None,
    verify_costs: Sequence[float] | None = None,
    forward_costs: tuple[float, float] | None = None,
) -> dict:
    """Measure our speculative decoder against the target alone and HF assisted generation.

    For each ``(prompt_id, category, input_ids)``: the target alone
    (:func:`run_target_alone`, ``target_engine``), ``speculative_generate``,
    and if ``hf_assisted`` ``target.generate(assistant_model=drafter)`` with
    the same draft length, schedule and confidence threshold. Short warm-up
    runs precede the timings.

    ``schedule="auto"`` first calibrates on up to 2 prompts with
    K = ``max_draft_length`` (default 8): per-position acceptance, c and the
    verification costs give K by :func:`decode.draft_length.choose_draft_length`;
    the benchmark then runs a constant schedule at that K (the choice is under
    ``auto_draft_length``).

    Speeds are decode-only: tokens / seconds after the prompt prefill,
    pooled over prompts. ``speedup`` = speculative / target tokens per second.
    ``theoretical_speedup`` is Leviathan et al. 2023 Thm 3.8 at the measured
    ``alpha`` (accepted / verified positions), the mean drafted K and
    ``cost_ratio`` c (drafter / target 1-token forward time, measured on up
    to 3 prompts); ``cost_model_speedup`` replaces its free verification by
    the measured cost of a (K+1)-token target forward (``verify_cost``).

    Args:
        target, drafter: causal LMs sharing a tokenizer, eval mode, same device.
        prompts: ``(prompt_id, category, token ids)`` triples, at least one.
        draft_length: K >= 1 (the starting K of the heuristic schedule).
        max_new_tokens: per prompt.
        eos_token_ids: generation stops at any of these.
        temperature: 0 = greedy (outputs are compared token for token);
            > 0 samples (``outputs_match_target`` is then None).
        top_k, top_p: sampling filters (0 / 1.0 = off), applied to both models.
        schedule: ``constant``, ``heuristic`` or ``auto`` (see above).
        max_draft_length: cap of the heuristic schedule; calibration K of ``auto``.
        confidence_threshold: stop drafting below this drafter probability (0 = off).
        stop_strings, tokenizer: stop texts (applied to every decoder).
        hf_assisted: also run HF assisted generation.
        hf_drafter: the drafter module HF assisted generation uses; None = ``drafter`` itself
            (pass the unquantized drafter to compare against what a transformers user runs).
        target_engine: ``hf`` or ``loop``, see :func:`run_target_alone`.
        progress: show a tqdm bar with the running acceptance rate.
        seed: seeds the per-prompt generators when sampling.
        target_outputs: the target-alone runs of these prompts from :func:`run_target_alone`
            (same settings), to measure several drafters against one baseline run; None runs it here.
        verify_costs: the target's verification costs from an earlier call (``verify_costs`` of its result),
            which depend on the target alone; None measures them here (:func:`measure_verify_costs` on the
            first 3 prompts in ``VERIFY_ROUNDS`` rounds, made non-decreasing by :func:`monotone_verify_costs`;
            the raw medians are ``verify_costs_measured``, the rounds ``verify_cost_rounds``).
        forward_costs: ``(target 1-token forward in s, c)`` from an earlier measurement of these models
            (:func:`decode.costs.measure_cost_ratios`, which times several drafters side by side); None times both here
            (:func:`measure_forward_seconds` on the first 3 prompts, one more prefill of each model per prompt).

    Returns:
        A dict: ``acceptance_rate``, ``alpha``, ``mean_accepted_tokens`` (tau,
        +1 included), ``per_position_acceptance``, ``draft_length``,
        ``mean_draft_length``, ``num_prompts``, ``new_tokens``,
        ``target_tokens_per_s``, ``speculative_tokens_per_s``, ``speedup``,
        ``cost_ratio``, ``verify_cost``, ``theoretical_speedup``,
        ``cost_model_speedup``, ``measured_over_theoretical``, ``target_forward_s``,
        ``block_seconds`` (one block measured against its forwards timed alone: :func:`block_seconds`),
        ``draft_length_choice`` (recommended K, the article's rule of thumb,
        expected speedup per K), ``outputs_match_target``, ``baselines``
        (``target``, ``hf_assisted`` or None), ``per_category`` (category ->
        the same figures), ``per_prompt``, ``schedule``, ``notes`` (list of
        str, e.g. why HF assisted was skipped: transformers refuses an
        assistant whose vocabulary size differs from the target's unless
        given both tokenizers).

    Raises:
        ValueError: no prompts, or arguments rejected by the decoders.
    """
    if not prompts:
        raise ValueError("benchmark needs at least one prompt")
    if target_outputs is not None and len(target_outputs) != len(prompts):
        raise ValueError(f"target_outputs has {len(target_outputs)} runs for {len(prompts)} prompts")
    if schedule not in ("constant", "heuristic", "auto"):
        raise ValueError(f"unknown schedule {schedule!r}: choose constant, heuristic or auto")
    device, greedy = target.device, temperature == 0
    vocab = min(vocab_size_of(target), vocab_size_of(drafter))
    decode_args = dict(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, temperature=temperature,
                       top_k=top_k, top_p=top_p, stop_strings=stop_strings, tokenizer=tokenizer)
    notes = []

    auto = None
    if schedule == "auto":
        auto = _calibrate_draft_length(target, drafter, prompts, decode_args, max_draft_length=max_draft_length,
                                       confidence_threshold=confidence_threshold, seed=seed)
        draft_length, schedule = auto["best_draft_length"], "constant"
        notes.append(f"auto draft length: K = {draft_length} chosen from a calibration at K = "
                     f"{auto['calibration_draft_length']} on {len(auto['calibration_prompts'])} of these prompts "
                     f"(rule of thumb K = max(2, int(accuracy x 5)) says {auto['rule_of_thumb']})")
    spec_args = dict(draft_length=draft_length, schedule=schedule, max_draft_length=max_draft_length,
                     confidence_threshold=confidence_threshold)

    warm_up = torch.tensor([prompts[0][2]], device=device)
    warm_args = {**decode_args, "max_new_tokens": min(2 * draft_length + 2, max_new_tokens)}
    speculative_generate(target, drafter, warm_up, **spec_args, **warm_args)
    if target_outputs is None:
        target_outputs = run_target_alone(target, prompts, **decode_args, seed=seed, vocab_size=vocab,
                                          engine=target_engine, progress=progress)
    hf_drafter = drafter if hf_drafter is None else hf_drafter
    hf_assisted = hf_assisted and _hf_assisted_comparable(target, hf_drafter, notes)
    hf_args = dict(draft_length=draft_length, schedule=schedule, confidence_threshold=confidence_threshold)
    if hf_assisted:
        _hf_assisted_generate(target, hf_drafter, warm_up, **hf_args, **warm_args)

    bar = tqdm(prompts, desc=f"speculative K={draft_length} ({schedule})", unit="prompt", disable=not progress)
    with heartbeat(bar, target=target):  # the target's forwards: one hook call per layer, not per drafted token
        runs = _timed_runs(target, drafter, bar, target_outputs, spec_args, decode_args, seed=seed,
                           hf_drafter=hf_drafter if hf_assisted else None, hf_args=hf_args)

    target_forward_s, cost_ratio, verify_costs, verify_rounds = _measure_costs(
        target, drafter, prompts, runs, draft_length, notes, verify_costs, forward_costs, progress=progress)

    def figures(subset):
        return _speed_figures(subset, draft_length, cost_ratio, greedy, verify_costs, target_engine, target_forward_s)

    result = figures(runs)
    result["schedule"] = {"name": schedule if auto is None else "auto", "max_draft_length": max_draft_length,
                          "confidence_threshold": confidence_threshold}
    if auto is not None:
        result["auto_draft_length"] = auto
    result["verify_costs"] = verify_costs
    result["verify_costs_measured"] = (
        [statistics.median(r[n] for r in verify_rounds) for n in range(len(verify_costs))] if verify_rounds else None)
    result["verify_cost_rounds"] = verify_rounds
    result["target_forward_s"] = target_forward_s  # 1-token target forward with a cache, timed alone
    result["notes"] = notes
    result["per_category"] = {category: figures([r for r in runs if r.category == category])
                              for category in sorted({r.category for r in runs})}
    result["per_prompt"] = _per_prompt_rows(runs, greedy)
    return result


def _hf_assisted_comparable(target, hf_drafter, notes: list[str]) -> bool:
    """Whether transformers' assisted generation can run with ``hf_drafter`` as it runs ours; if not, why goes to
    ``notes`` (and a warning)."""
    if vocab_size_of(target) == vocab_size_of(hf_drafter):
        return True
    # transformers 5 takes a different vocabulary size for a different tokenizer and then
    # requires `tokenizer`/`assistant_tokenizer` (universal assisted decoding), not comparable.
    notes.append(f"HF assisted generation skipped: vocabulary sizes differ "
                 f"({vocab_size_of(target)} vs {vocab_size_of(hf_drafter)}), which transformers treats as "
                 f"different tokenizers")
    warnings.warn(notes[-1], stacklevel=3)
    return False


def _timed_runs(target, drafter, bar, target_outputs, spec_args: dict, decode_args: dict, *, seed: int,
                hf_drafter=None, hf_args: dict | None = None) -> list[_PromptRun]:
    """Our decoder (and, with ``hf_drafter``, transformers' assisted generation) on each prompt of ``bar`` (a tqdm
    over ``(prompt_id, category, ids)``), beside its target-alone run; the bar shows the running acceptance."""
    device, runs = target.device, []
    for i, (prompt_id, category, ids) in enumerate(bar):
        input_ids = torch.tensor([list(ids)], device=device)
        run = _PromptRun(prompt_id, category, target=target_outputs[i], speculative=speculative_generate(
            target, drafter, input_ids, **spec_args, **decode_args,
            generator=torch.Generator(device=device).manual_seed(seed)))
        if hf_drafter is not None:
            if decode_args["temperature"] > 0:
                torch.manual_seed(seed)
            run.hf_tokens, wall_s = _hf_assisted_generate(target, hf_drafter, input_ids, **hf_args, **decode_args)
            # HF does not time its prefill: subtract a separately timed prefill of both of its models
            prefill_s = _prefill_seconds(target, input_ids) + _prefill_seconds(hf_drafter, input_ids)
            run.hf_decode_s = max(wall_s - prefill_s, 1e-9)
        runs.append(run)
        pooled = DecodeStats.merge([r.speculative.stats for r in runs])
        bar.set_postfix(acceptance=f"{pooled.acceptance_rate:.3f}", tau=f"{pooled.mean_accepted_tokens:.2f}")
    return runs


def _calibrate_draft_length(target, drafter, prompts, decode_args: dict, *, max_draft_length: int | None,
                            confidence_threshold: float, seed: int) -> dict:
    """``decode.schedule=auto``: a short benchmark of the first 2 prompts at K = ``max_draft_length`` (8 if
    None), up to 64 tokens; returns its ``draft_length_choice`` with the calibration's prompts and K."""
    calibration_k = max_draft_length or 8
    calibration = benchmark(target, drafter, prompts[:2], draft_length=calibration_k,
                            **{**decode_args, "max_new_tokens": min(64, decode_args["max_new_tokens"])},
                            confidence_threshold=confidence_threshold, hf_assisted=False,
                            target_engine="loop", progress=False, seed=seed)
    return {"calibration_prompts": [p[0] for p in prompts[:2]], "calibration_draft_length": calibration_k,
            **calibration["draft_length_choice"]}


def _measure_costs(target, drafter, prompts, runs: list[_PromptRun], draft_length: int, notes: list[str],
                   given_verify: Sequence[float] | None, given_forward: tuple[float, float] | None = None,
                   progress: bool = False) -> tuple[float, float, list[float], list[list[float]] | None]:
    """The cost model's inputs, timed on the first 3 prompts unless given: ``(one-token target forward in s, c,
    verify costs per length in one-token target forwards (non-decreasing), the raw rounds ``(rounds, lengths)``
    behind them or None when ``given_verify`` was used)``; a verification cost that makes speculation pay little
    is added to ``notes`` and printed."""
    calibration_ids = [ids for _, _, ids in prompts[:3]]
    if given_forward is not None:
        target_forward_s, cost_ratio = given_forward
    else:
        target_forward_s, draft_forward_s = measure_forward_seconds(target, drafter, calibration_ids)
        cost_ratio = draft_forward_s / target_forward_s
    longest = max(max(r.speculative.stats.drafted_per_block, default=0) for r in runs)
    wanted = min(max(MIN_VERIFY_LENGTHS, longest), 16) + 1
    rounds = None
    if given_verify is not None and len(given_verify) >= wanted:
        verify_costs = list(given_verify)
    else:
        verify_costs, _, rounds = timed_verify_costs(target, calibration_ids, wanted, rounds=VERIFY_ROUNDS,
                                                     progress=progress)
    slow_verify = verify_costs[min(draft_length, len(verify_costs) - 1)]
    if slow_verify > 2.0:
        notes.append(f"verifying K + 1 = {draft_length + 1} tokens cost {slow_verify:.1f} one-token target forwards on "
                     f"this host (about 1 where the weights are read once): speculation pays little here; see "
                     f"docs/cpu_linear.md (float32 CPU layers go through oneDNN, decode.cpu_linear.use_onednn_linear)")
        print(f"benchmark: warning: {notes[-1]}", flush=True)
    return target_forward_s, cost_ratio, verify_costs, rounds


def _per_prompt_rows(runs: list[_PromptRun], greedy: bool) -> list[dict]:
    """One row per prompt: its figures, blocks and tokens (what a simulation of this decoder is checked against)."""
    return [
        {
            "prompt_id": r.prompt_id,
            "category": r.category,
            "new_tokens": r.speculative.stats.new_tokens,
            "acceptance_rate": r.speculative.stats.acceptance_rate,
            "mean_accepted_tokens": r.speculative.stats.mean_accepted_tokens,
            "target_tokens_per_s": r.target.stats.tokens_per_s,
            "speculative_tokens_per_s": r.speculative.stats.tokens_per_s,
            "outputs_match_target": torch.equal(r.speculative.new_tokens, r.target.new_tokens) if greedy else None,
            "first_divergence": first_divergence(r.speculative.new_tokens, r.target.new_tokens) if greedy else None,
            # the blocks and tokens themselves, to check a simulation of this decoder against (decode.acceptance)
            "accepted_per_block": r.speculative.stats.accepted_per_block,
            "drafted_per_block": r.speculative.stats.drafted_per_block,
            "output_ids": r.speculative.new_tokens.tolist(),
        }
        for r in runs
    ]
