"""Target alone, HF assisted generation and our speculative decoder on the same prompts.

All three run batch size 1 on the same token ids. Speeds are decode-only
(tokens / seconds after the prompt prefill), pooled over prompts
(total new tokens / total decode seconds), and belong to the torch stack
these models run in (a llama.cpp build of the same models behaves differently).
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from decode.metrics import DecodeStats, theoretical_speedup
from decode.speculative import (
    SpeculativeOutput,
    _crop,
    _forward,
    _prefill,
    _sync,
    _vocab_size,
    speculative_generate,
    target_generate,
)


@dataclass
class _PromptRun:
    prompt_id: str
    category: str
    target: SpeculativeOutput
    speculative: SpeculativeOutput
    hf_tokens: torch.Tensor | None = None
    hf_decode_s: float = 0.0


@torch.inference_mode()
def forward_seconds(model, input_ids: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one cached 1-token forward of ``model`` after prefilling ``input_ids`` ``(1, L)``."""
    cache = _prefill(model, input_ids)
    last = input_ids[:, -1:].to(model.device)
    times = []
    for i in range(repeats + 1):  # the first call warms up and is not counted
        _sync(model.device)
        start = time.perf_counter()
        _forward(model, last, cache, last_only=True)
        _sync(model.device)
        if i:
            times.append(time.perf_counter() - start)
        _crop(cache, input_ids.shape[1] - 1)
    return statistics.median(times)


def measure_cost_ratio(target, drafter, prompts_ids: Sequence[Sequence[int]], repeats: int = 5) -> float:
    """c = drafter 1-token forward time / target 1-token forward time (Leviathan et al. 2023, Sec. 3).

    Both are measured with a KV cache after prefilling each prompt, median
    over ``repeats`` calls, summed over the prompts.

    Raises:
        ValueError: no prompts.
    """
    if not prompts_ids:
        raise ValueError("measure_cost_ratio needs at least one prompt")
    target_s = draft_s = 0.0
    for ids in prompts_ids:
        input_ids = torch.tensor([list(ids)], device=target.device)
        target_s += forward_seconds(target, input_ids, repeats)
        draft_s += forward_seconds(drafter, input_ids, repeats)
    return draft_s / target_s


def _hf_assisted_generate(target, drafter, input_ids, *, draft_length, max_new_tokens, eos_token_ids,
                          temperature, top_k=0, top_p=1.0) -> tuple[torch.Tensor, float]:
    """HF assisted generation with a constant draft length; returns (new tokens, wall seconds)."""
    # The candidate generator reads these from the *assistant's* generation config; the
    # "heuristic" schedule would also write the draft length back there between calls.
    saved = copy.deepcopy(drafter.generation_config)
    drafter.generation_config.num_assistant_tokens = draft_length
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0  # 0 disables early draft stopping
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, repetition_penalty=1.0,
        num_assistant_tokens=draft_length, num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )
    if eos_token_ids:
        kwargs.update(eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0])
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
    try:
        _sync(target.device)
        start = time.perf_counter()
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 assistant_model=drafter, **kwargs)
        _sync(target.device)
        seconds = time.perf_counter() - start
    finally:
        drafter.generation_config = saved
    return output[0, input_ids.shape[1]:], seconds


def _figures(runs: list[_PromptRun], draft_length: int, cost_ratio: float, greedy: bool) -> dict:
    target = DecodeStats.merge([r.target.stats for r in runs])
    spec = DecodeStats.merge([r.speculative.stats for r in runs])
    figures = {
        "num_prompts": len(runs),
        "draft_length": draft_length,
        "new_tokens": spec.new_tokens,
        "acceptance_rate": spec.acceptance_rate,
        "alpha": spec.alpha,
        "mean_accepted_tokens": spec.mean_accepted_tokens,
        "per_position_acceptance": spec.per_position_acceptance,
        "target_tokens_per_s": target.tokens_per_s,
        "speculative_tokens_per_s": spec.tokens_per_s,
        "speedup": spec.tokens_per_s / target.tokens_per_s if target.tokens_per_s else 0.0,
        "cost_ratio": cost_ratio,
        "theoretical_speedup": theoretical_speedup(spec.alpha, draft_length, cost_ratio),
        "outputs_match_target": (all(torch.equal(r.speculative.new_tokens, r.target.new_tokens) for r in runs)
                                 if greedy else None),
        "baselines": {
            "target": {"tokens_per_s": target.tokens_per_s, "new_tokens": target.new_tokens,
                       "decode_s": target.decode_s, "prefill_s": target.prefill_s},
            "hf_assisted": None,
        },
    }
    if all(r.hf_tokens is not None for r in runs):
        hf_tokens = sum(len(r.hf_tokens) for r in runs)
        hf_decode_s = sum(r.hf_decode_s for r in runs)
        hf_tokens_per_s = hf_tokens / hf_decode_s if hf_decode_s > 0 else 0.0
        figures["baselines"]["hf_assisted"] = {
            "tokens_per_s": hf_tokens_per_s,
            "new_tokens": hf_tokens,
            "decode_s": hf_decode_s,
            "speedup": hf_tokens_per_s / target.tokens_per_s if target.tokens_per_s else 0.0,
            "outputs_match_target": (all(torch.equal(r.hf_tokens.to(r.target.new_tokens.device),
                                                     r.target.new_tokens) for r in runs)
                                     if greedy else None),
        }
    return figures


def run_target_alone(target, prompts: list[tuple[str, str, list[int]]], *, max_new_tokens: int,
                     eos_token_ids: Sequence[int], temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0, vocab_size: int | None = None, progress: bool = True) -> list[SpeculativeOutput]:
    """The target decoding alone on each prompt (our KV-cached loop), for :func:`benchmark`'s ``target_outputs``.

    Args:
        prompts: ``(prompt_id, category, token ids)`` triples.
        vocab_size: sample over the first ``vocab_size`` logits (the vocabulary shared with the drafters).
    Returns:
        one :class:`SpeculativeOutput` per prompt, with decode-only timings in its stats.
    """
    device = target.device
    warm_up = torch.tensor([prompts[0][2]], device=device)
    target_generate(target, warm_up, max_new_tokens=min(4, max_new_tokens), eos_token_ids=eos_token_ids,
                    temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=vocab_size)
    outputs = []
    for _, _, ids in tqdm(prompts, desc="target alone", unit="prompt", disable=not progress):
        outputs.append(target_generate(
            target, torch.tensor([list(ids)], device=device), max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=torch.Generator(device=device).manual_seed(seed), vocab_size=vocab_size))
    return outputs


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
    hf_assisted: bool = True,
    progress: bool = True,
    seed: int = 0,
    target_outputs: Sequence[SpeculativeOutput] | None = None,
) -> dict:
    """Measure our speculative decoder against the target alone and HF assisted generation.

    For each ``(prompt_id, category, input_ids)``: ``target_generate``
    (baseline, sampling over the common vocabulary), ``speculative_generate``,
    and if ``hf_assisted`` ``target.generate(assistant_model=drafter)`` with a
    constant ``num_assistant_tokens = draft_length`` and no confidence
    threshold. A short warm-up run precedes the timings.

    Speeds are decode-only: tokens / seconds after the prompt prefill,
    pooled over prompts. HF does not report its prefill separately, so its
    decode seconds are its wall time minus our measured prefill of both
    models on the same prompt (an approximation). ``speedup`` =
    speculative / target tokens per second. ``theoretical_speedup`` is
    Leviathan et al. 2023 Thm 3.8 at the measured ``alpha`` (accepted /
    verified positions) and ``cost_ratio`` c (drafter / target 1-token
    forward time, measured separately on up to 3 prompts).

    Args:
        target, drafter: causal LMs sharing a tokenizer, eval mode, same device.
        prompts: ``(prompt_id, category, token ids)`` triples, at least one.
        draft_length: K >= 1.
        max_new_tokens: per prompt.
        eos_token_ids: generation stops at any of these.
        temperature: 0 = greedy (outputs are compared token for token);
            > 0 samples (``outputs_match_target`` is then None).
        top_k, top_p: sampling filters (0 / 1.0 = off), applied to both models.
        hf_assisted: also run HF assisted generation.
        progress: show a tqdm bar with the running acceptance rate.
        seed: seeds the per-prompt generators when sampling.
        target_outputs: the target-alone runs of these prompts from :func:`run_target_alone`
            (same settings), to measure several drafters against one baseline run; None runs it here.

    Returns:
        A dict: ``acceptance_rate``, ``alpha``, ``mean_accepted_tokens`` (tau,
        +1 included), ``per_position_acceptance``, ``draft_length``,
        ``num_prompts``, ``new_tokens``, ``target_tokens_per_s``,
        ``speculative_tokens_per_s``, ``speedup``, ``cost_ratio``,
        ``theoretical_speedup``, ``outputs_match_target``, ``baselines``
        (``target``, ``hf_assisted`` or None), ``per_category`` (category ->
        the same figures), ``per_prompt`` (list of per-prompt figures),
        ``notes`` (list of str, e.g. why HF assisted was skipped: transformers
        refuses an assistant whose vocabulary size differs from the target's
        unless given both tokenizers).

    Raises:
        ValueError: no prompts, or arguments rejected by the decoders.
    """
    if not prompts:
        raise ValueError("benchmark needs at least one prompt")
    if target_outputs is not None and len(target_outputs) != len(prompts):
        raise ValueError(f"target_outputs has {len(target_outputs)} runs for {len(prompts)} prompts")
    device, greedy = target.device, temperature == 0
    vocab = min(_vocab_size(target), _vocab_size(drafter))
    decode_args = dict(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, temperature=temperature,
                       top_k=top_k, top_p=top_p)

    def generator() -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    warm_up = torch.tensor([prompts[0][2]], device=device)
    target_generate(target, warm_up, **{**decode_args, "max_new_tokens": min(4, max_new_tokens)}, vocab_size=vocab)
    speculative_generate(target, drafter, warm_up, draft_length=draft_length,
                         **{**decode_args, "max_new_tokens": min(2 * draft_length + 2, max_new_tokens)})
    notes = []
    if hf_assisted and _vocab_size(target) != _vocab_size(drafter):
        # transformers 5 takes a different vocabulary size for a different tokenizer and then
        # requires `tokenizer`/`assistant_tokenizer` (universal assisted decoding), not comparable.
        hf_assisted = False
        notes.append(f"HF assisted generation skipped: vocabulary sizes differ "
                     f"({_vocab_size(target)} vs {_vocab_size(drafter)}), which transformers treats as "
                     f"different tokenizers")
        warnings.warn(notes[-1], stacklevel=2)
    if hf_assisted:
        _hf_assisted_generate(target, drafter, warm_up, draft_length=draft_length,
                              **{**decode_args, "max_new_tokens": min(2 * draft_length + 2, max_new_tokens)})

    runs: list[_PromptRun] = []
    bar = tqdm(prompts, desc=f"speculative K={draft_length}", unit="prompt", disable=not progress)
    for i, (prompt_id, category, ids) in enumerate(bar):
        input_ids = torch.tensor([list(ids)], device=device)
        run = _PromptRun(
            prompt_id, category,
            target=target_outputs[i] if target_outputs is not None else
            target_generate(target, input_ids, **decode_args, generator=generator(), vocab_size=vocab),
            speculative=speculative_generate(target, drafter, input_ids, draft_length=draft_length,
                                             **decode_args, generator=generator()),
        )
        if hf_assisted:
            run.hf_tokens, wall_s = _hf_assisted_generate(target, drafter, input_ids, draft_length=draft_length,
                                                          **decode_args)
            run.hf_decode_s = max(wall_s - run.speculative.stats.prefill_s, 1e-9)
        runs.append(run)
        pooled = DecodeStats.merge([r.speculative.stats for r in runs])
        bar.set_postfix(acceptance=f"{pooled.acceptance_rate:.3f}", tau=f"{pooled.mean_accepted_tokens:.2f}")

    cost_ratio = measure_cost_ratio(target, drafter, [ids for _, _, ids in prompts[:3]])
    result = _figures(runs, draft_length, cost_ratio, greedy)
    result["notes"] = notes
    result["per_category"] = {
        category: _figures([r for r in runs if r.category == category], draft_length, cost_ratio, greedy)
        for category in sorted({r.category for r in runs})
    }
    result["per_prompt"] = [
        {
            "prompt_id": r.prompt_id,
            "category": r.category,
            "new_tokens": r.speculative.stats.new_tokens,
            "acceptance_rate": r.speculative.stats.acceptance_rate,
            "mean_accepted_tokens": r.speculative.stats.mean_accepted_tokens,
            "target_tokens_per_s": r.target.stats.tokens_per_s,
            "speculative_tokens_per_s": r.speculative.stats.tokens_per_s,
            "outputs_match_target": torch.equal(r.speculative.new_tokens, r.target.new_tokens) if greedy else None,
        }
        for r in runs
    ]
    return result
