"""What a forward costs: c (drafter / target one-token forward time) and the target's verification costs,
timed in interleaved rounds and returned as estimates with their spread (:mod:`decode.timing`).

c and the verification costs are the cost model's inputs (Leviathan et al. 2023, Sec. 3): with exact tau
they predict a drafter's speedup. Every figure here is a time on this machine, so each comes from rounds that
a slow spell of the machine falls on alike, with a check of whether it did.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from decode.model_calls import crop, forward, prefill, sync
from decode.timing import (
    NOISY_SPREAD,
    CpuWatch,
    median_ci,
    relative_spread,
    timing_check,
)


@torch.inference_mode()
def forward_seconds(model, input_ids: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one cached 1-token forward of ``model`` after prefilling ``input_ids`` ``(1, L)``."""
    cache = prefill(model, input_ids)
    last = input_ids[:, -1:].to(model.device)
    _timed_forwards(model, last, cache, 1)  # warm-up, not counted
    return statistics.median(_timed_forwards(model, last, cache, repeats))


def _timed_forwards(model, last: torch.Tensor, cache, repeats: int) -> list[float]:
    """Seconds of ``repeats`` cached forwards of the one token ``last`` ``(1, 1)`` after the prefilled ``cache``,
    which is cropped back after each (so every call sees the same context)."""
    base = cache.get_seq_length()
    times = []
    for _ in range(repeats):
        sync(model.device)
        start = time.perf_counter()
        forward(model, last, cache, last_only=True)
        sync(model.device)
        times.append(time.perf_counter() - start)
        crop(cache, base)
    return times


def measure_forward_seconds(target, drafter, prompts_ids: Sequence[Sequence[int]],
                            repeats: int = 5) -> tuple[float, float]:
    """Seconds of one cached 1-token forward of the target and of the drafter, each the median over
    ``repeats`` calls after prefilling a prompt, averaged over the prompts ``prompts_ids``.

    Raises:
        ValueError: no prompts.
    """
    if not prompts_ids:
        raise ValueError("measure_forward_seconds needs at least one prompt")
    target_s = draft_s = 0.0
    for ids in prompts_ids:
        input_ids = torch.tensor([list(ids)], device=target.device)
        target_s += forward_seconds(target, input_ids, repeats)
        draft_s += forward_seconds(drafter, input_ids, repeats)
    return target_s / len(prompts_ids), draft_s / len(prompts_ids)


@torch.inference_mode()
def measure_cost_ratios(target, drafters: dict[str, Any], prompts_ids: Sequence[Sequence[int]], *, rounds: int = 5,
                        max_rounds: int = 20, repeats: int = 3, seed: int = 0, progress: bool = True
                        ) -> dict[str, Any]:
    """c of every drafter in ``drafters`` ({name: model as the decoder runs it}), timed side by side, as an
    estimate with its interval.

    Each model prefills each prompt once; then every round times ``repeats`` cached 1-token forwards of the
    target and of every drafter on every prompt (the cache cropped back after each; the models' order rotating
    from round to round), so a slow spell of the machine falls on all of them alike. A round's time of a model
    is the median of its ``repeats`` forwards, averaged over the prompts; a round's ``c = drafter time / target
    time`` (Leviathan et al. 2023, Sec. 3). c is the median of the rounds' c, its interval a bootstrap over
    rounds (:func:`decode.timing.median_ci`). ``rounds`` rounds run first and ``rounds`` more at a time while
    any c's rounds spread wider than :data:`decode.timing.NOISY_SPREAD`, up to ``max_rounds``;
    :func:`decode.timing.timing_check` then says whether the machine disturbed them.

    Drafters with equal :func:`cost_signature` (the same modules and tensor shapes, other values: a LoRA-merged
    drafter and its base with the same head) compute the same and get one c, from the mean of their rounds:
    the timing noise between them would otherwise pass for a difference in cost.

    Returns:
        ``{"cost_ratios": {name: c}, "cost_ratios_measured": {name: c before pooling}, "pooled": [[names that
        share one c], ...], "target_forward_ms": ms, "drafter_forward_ms": {name: ms}, "cost_ratio_range":
        {name: [lowest, highest] c over the rounds}, "cost_ratio_ci95": {name: [lo, hi]}, "cost_ratio_rounds":
        {name: [c of each round]} (of the pooled rounds for a shared c), "target_forward_ms_rounds": [ms],
        "cost_ratio_quiet_floor": {name: fastest drafter round / fastest target round}, "cost_ratio_from_shapes":
        {name: weight bytes read per token, drafter / target}, "timing": :func:`decode.timing.timing_check`,
        "signatures": {name: :func:`signature_digest`}, "target_signature": the target's, "rounds": rounds run,
        "prompts": n}``.

    Raises:
        ValueError: no prompts, no drafters, ``rounds`` / ``repeats`` below 1 or ``max_rounds`` below ``rounds``.
    """
    if not prompts_ids or not drafters or rounds < 1 or repeats < 1 or max_rounds < rounds:
        raise ValueError("measure_cost_ratios needs prompts, drafters, rounds, repeats >= 1 and max_rounds >= rounds")
    models = {"\0target": target, **drafters}
    inputs = [torch.tensor([list(ids)], device=target.device) for ids in prompts_ids]
    # the bar moves between prefills and between rounds, never inside a timed forward
    bar = tqdm(total=len(inputs) + rounds, desc="c: prefill, then timed rounds", unit="step", disable=not progress)
    caches = []
    for input_ids in inputs:
        caches.append({name: prefill(model, input_ids) for name, model in models.items()})
        for name, model in models.items():  # warm-up, not counted
            _timed_forwards(model, input_ids[:, -1:], caches[-1][name], 1)
        bar.update(1)
    per_round: dict[str, list[float]] = {name: [] for name in models}
    with CpuWatch() as watch:
        while True:
            for _ in range(rounds):
                _one_round(models, inputs, caches, per_round, repeats)
                bar.update(1)
            done = len(per_round["\0target"])
            spread = max(relative_spread(_ratios(per_round, name)) for name in drafters)
            if done + rounds > max_rounds or spread <= NOISY_SPREAD:
                break
            bar.total += rounds  # the rounds disagree: more of them
            bar.set_postfix(spread=f"{spread:.2f}")
    bar.close()
    del caches
    return _cost_ratio_estimates(per_round, drafters, watch.others_share, seed) | {
        "cost_ratio_from_shapes": {name: weight_bytes_per_token(model) / weight_bytes_per_token(target)
                                   for name, model in drafters.items()},
        "signatures": {name: signature_digest(model) for name, model in models.items() if name != "\0target"},
        "target_signature": signature_digest(target), "prompts": len(prompts_ids)}


def _one_round(models: dict[str, Any], inputs: list[torch.Tensor], caches: list[dict], per_round: dict[str, list],
               repeats: int) -> None:
    """Time every model once on every prompt, the models' order rotated by the round's index; appends each
    model's mean over prompts of its median forward (s) to ``per_round``."""
    names = list(models)
    shift = len(per_round[names[0]]) % len(names)
    order = names[shift:] + names[:shift]
    spent = dict.fromkeys(names, 0.0)
    for input_ids, cache in zip(inputs, caches):
        for name in order:
            spent[name] += statistics.median(_timed_forwards(models[name], input_ids[:, -1:], cache[name], repeats))
    for name in names:
        per_round[name].append(spent[name] / len(inputs))


def _ratios(per_round: dict[str, list[float]], name: str) -> list[float]:
    return [d / t for d, t in zip(per_round[name], per_round["\0target"])]


def _cost_ratio_estimates(per_round: dict[str, list[float]], drafters: dict[str, Any], others_share: float | None,
                          seed: int) -> dict[str, Any]:
    """:func:`measure_cost_ratios`' figures from the rounds' seconds ``per_round`` ({name: [s]}, the target's
    under ``"\\0target"``)."""
    target_rounds = per_round["\0target"]
    spread = {name: _ratios(per_round, name) for name in drafters}
    measured = {name: statistics.median(c) for name, c in spread.items()}
    pooled = [group for group in _same_cost_groups(drafters) if len(group) > 1]
    ratios = dict(measured)
    for group in pooled:  # one c for drafters that compute the same: the mean of their rounds, then the median
        rounds_mean = [statistics.fmean(spread[name][r] for name in group) for r in range(len(target_rounds))]
        ratios.update({name: statistics.median(rounds_mean) for name in group})
        spread.update({name: rounds_mean for name in group})  # the range shown beside the shared c is its own
    return {"cost_ratios": ratios, "cost_ratios_measured": measured, "pooled": pooled,
            "target_forward_ms": 1000 * statistics.median(target_rounds),
            "drafter_forward_ms": {name: 1000 * statistics.median(per_round[name]) for name in drafters},
            "cost_ratio_range": {name: [min(c), max(c)] for name, c in spread.items()},
            "cost_ratio_ci95": {name: median_ci(c, seed=seed) for name, c in spread.items()},
            "cost_ratio_rounds": spread, "target_forward_ms_rounds": [1000 * t for t in target_rounds],
            "cost_ratio_quiet_floor": {name: min(per_round[name]) / min(target_rounds) for name in drafters},
            "timing": timing_check({"target forward": target_rounds, **{f"c of {n}": c for n, c in spread.items()}},
                                   others_share),
            "rounds": len(target_rounds)}


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one cached 1-token forward of ``model`` reads: every parameter, buffer and packed weight
    its modules hold (each tensor once: a tied head counts once; an int8 layer's packed weight by its int8
    elements), input embedding tables only by the one row a token looks up. Batch-1 decoding on a CPU is bound by these reads, so their ratio between a drafter and its
    target is a cost estimate from shapes alone (it leaves out per-layer overheads, which weigh most in small
    models)."""
    seen: set[int] = set()
    alive: list[torch.Tensor] = []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_weight = id(head.weight) if head is not None and getattr(head, "weight", None) is not None else None
    total = 0
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        if callable(getattr(module, "weight", None)) and not isinstance(module.weight, torch.Tensor):
            tensors.append(module.weight())  # a quantized layer's packed weight, unpacked: its int8 elements
        for tensor in tensors:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            alive.append(tensor)  # an unpacked weight is a temporary: its id must not be reused by the next one
            size = tensor.numel() * tensor.element_size()
            if id(tensor) in embeddings and id(tensor) != head_weight and tensor.dim() == 2:
                size = tensor.shape[1] * tensor.element_size()
            total += size
    return total


def cost_signature(model) -> tuple:
    """What a forward's cost depends on: every module's class and settings and the shape and dtype of every
    tensor it holds (parameters, buffers, packed weights), not their values. Two drafters with equal signatures
    (a LoRA-merged drafter and the base it was trained from, with the same head) run the same kernels on the
    same shapes, so they cost the same (dense kernels do not look at the values)."""
    parts = []
    for name, module in model.named_modules():
        tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False)),
                   **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        parts.append((name, type(module).__name__, module.extra_repr(),
                      tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in tensors.items()))))
    return tuple(parts)


def signature_digest(model) -> str:
    """:func:`cost_signature` as 16 hex digits (sha256): equal for models that compute the same shapes."""
    return hashlib.sha256(repr(cost_signature(model)).encode()).hexdigest()[:16]


def _same_cost_groups(drafters: dict[str, Any]) -> list[list[str]]:
    """``drafters``' names grouped by :func:`cost_signature`, in the order they first appear."""
    groups: dict[tuple, list[str]] = {}
    for name, model in drafters.items():
        groups.setdefault(cost_signature(model), []).append(name)
    return list(groups.values())


def measure_cost_ratio(target, drafter, prompts_ids: Sequence[Sequence[int]], repeats: int = 5) -> float:
    """c = drafter 1-token forward time / target 1-token forward time (Leviathan et al. 2023, Sec. 3).

    Both are measured with a KV cache after prefilling each prompt (:func:`measure_forward_seconds`).

    Raises:
        ValueError: no prompts.
    """
    target_s, draft_s = measure_forward_seconds(target, drafter, prompts_ids, repeats)
    return draft_s / target_s


def measure_verify_costs(target, prompts_ids: Sequence[Sequence[int]], max_tokens: int, repeats: int = 3) -> list[float]:
    """Cost of one cached target forward over n tokens in units of a 1-token forward, n = 1..max_tokens: the
    median over the rounds of :func:`measure_verify_cost_rounds` (``repeats`` rounds) at each n.

    Leviathan et al.'s Theorem 3.8 assumes 1.0 for every n (verification as cheap as a decoding step, as on a
    GPU); on a CPU it grows with n, which is why measured speedups there fall short of theirs.
    :func:`monotone_verify_costs` smooths the result.

    Raises:
        ValueError: no prompts, max_tokens < 1 or repeats < 1.
    """
    rounds = measure_verify_cost_rounds(target, prompts_ids, max_tokens, repeats)
    return [statistics.median(r[n] for r in rounds) for n in range(max_tokens)]


@torch.inference_mode()
def measure_verify_cost_rounds(target, prompts_ids: Sequence[Sequence[int]], max_tokens: int,
                               rounds: int = 3, progress: bool = False) -> list[list[float]]:
    """Verification costs of each timing round, ``(rounds, max_tokens)``: ``result[r][n - 1]`` = round r's time
    of a cached target forward over n tokens, summed over the prompts, over the same for 1 token.

    Each prompt is prefilled once; then each round times every length once on every prompt, in alternating
    order (1..max_tokens, then back), so that a slow spell of the machine falls on all lengths alike; a first
    round warms every length up and is not counted. ``progress``: a bar that moves after each prefill and each
    round, never inside a timed forward.

    Raises:
        ValueError: no prompts, max_tokens < 1 or rounds < 1.
    """
    if not prompts_ids or max_tokens < 1 or rounds < 1:
        raise ValueError("measure_verify_costs needs a prompt, max_tokens >= 1 and repeats >= 1")
    inputs = [torch.tensor([list(ids)], device=target.device) for ids in prompts_ids]
    bar = tqdm(total=len(inputs) + rounds + 1, desc=f"verification costs (1..{max_tokens} tokens): prefill, rounds",
               unit="step", disable=not progress)
    caches = []
    for input_ids in inputs:
        caches.append(prefill(target, input_ids))
        bar.update(1)
    lengths = list(range(1, max_tokens + 1))
    result = []
    for r in range(rounds + 1):  # round 0 warms up every length
        seconds = [0.0] * max_tokens
        for input_ids, cache in zip(inputs, caches):
            base = input_ids.shape[1] - 1
            for n in (lengths if r % 2 else lengths[::-1]):
                sync(target.device)
                start = time.perf_counter()
                forward(target, input_ids[:, -1:].repeat(1, n), cache)
                sync(target.device)
                seconds[n - 1] += time.perf_counter() - start
                crop(cache, base)
        if r:
            result.append([s / seconds[0] for s in seconds])
        bar.update(1)
    bar.close()
    return result


def timed_verify_costs(target, prompts_ids: Sequence[Sequence[int]], max_tokens: int, rounds: int,
                       progress: bool = False) -> tuple[list[float], list[float], list[list[float]]]:
    """The verification costs the cost model uses, for n = 1..max_tokens: ``(non-decreasing costs, their raw
    medians over the rounds, the rounds)`` (:func:`measure_verify_cost_rounds`, :func:`monotone_verify_costs`);
    ``progress``: its bar.

    Raises:
        ValueError: as :func:`measure_verify_cost_rounds`.
    """
    timing_rounds = measure_verify_cost_rounds(target, prompts_ids, max_tokens, rounds=rounds, progress=progress)
    measured = [statistics.median(r[n] for r in timing_rounds) for n in range(max_tokens)]
    return monotone_verify_costs(measured), measured, timing_rounds


def monotone_verify_costs(costs: Sequence[float]) -> list[float]:
    """Measured verification costs ``(n,)`` made non-decreasing: entries 2..n by the closest non-decreasing
    sequence (least squares: the pool-adjacent-violators algorithm), none below the first, the unit (the
    1-token forward), which stays as given.

    One more token in a forward never makes it cheaper on average, so a dip between neighbouring lengths is
    timing noise; pooling it keeps the choice of K from chasing it. Kernel steps (a jump at 4 or 8 rows) are
    kept: they are increases.
    """
    if not costs:
        return []
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for value in costs[1:]:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [costs[0]] + [max(costs[0], total / count) for total, count in blocks for _ in range(count)]


def machine_busy(who: str, seconds: float = 1.0) -> float | None:
    """Share of all CPUs (0-1) that other processes used over ``seconds`` while this one sat idle, printed as a
    warning (``<who>: warning: ...``) when they compete with a CPU measurement; None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    busy = psutil.cpu_percent(interval=seconds) / 100  # this process is idle meanwhile: the rest is others' work
    if busy > 0.25 and not torch.cuda.is_available():
        print(f"{who}: warning: other processes kept {busy:.0%} of the {os.cpu_count()} CPUs busy: the speed "
              "figures will be low and noisy (acceptance is unaffected); measure on an idle machine", flush=True)
    return round(busy, 3)
