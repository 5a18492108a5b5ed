"""Acceptance of speculative decoding computed exactly from one teacher-forced pass, without decoding.

Greedy. The decoder's output is the target's greedy answer ``a`` (``(n,)`` token ids), and inside a
block the drafter's j-th draft is conditioned on the target's own tokens for as long as the earlier
drafts matched. With ``m[t] = 1`` when the drafter's argmax after (prompt + ``a[:t]``) equals ``a[t]``,
a block starting at answer position p with k drafts accepts the leading run of ones in ``m[p:p+k]``
(cut at the first draft whose probability falls below a confidence threshold, and at the answer's
EOS, which is then the block's +1 token), and the next block starts at p + accepted + 1. So one
teacher-forced drafter forward over the answer fixes every block of the decoder, for every K and for
any schedule that depends only on accepted counts (constant, heuristic): :func:`simulate_greedy`.
The drafts after a block's first rejection are not simulated (the decoder's drafter conditions them
on its own wrong token): they change the drafted count only when a confidence threshold ends a block
early after its first rejection, and never the accepted counts.

Prompt lookup. Its drafts depend on the context alone: :func:`simulate_prompt_lookup` replays the
decoder's blocks over the target's answer with no model.

Sampling. Along an answer sampled from the target, ``beta_t = 1 - TV(p_target_t, q_draft_t)`` is the
probability that a draft at t is accepted given its context (Leviathan et al. 2023, Sec. 3, Def. 3.1 and
Lemma 3.3); :func:`expected_sampling_blocks` takes the expectation over independent accept/reject draws
along that fixed path (a dynamic programme over the block start). This is an approximation, not the
decoder's exact expectation: in the decoder an accepted draft is distributed as min(p, q) / beta and a
correction as the residual, not as p, so later contexts (and betas) depend on earlier outcomes. The test
against seeded decoder runs bounds the gap on a tiny vocabulary.

Totals pool blocks over prompts (``DecodeStats.merge``); intervals are percentile bootstraps over
prompts (Efron and Tibshirani 1993, ch. 13), paired for differences between drafters on the same prompts.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decode.draft_length import make_schedule
from decode.metrics import DecodeStats, verify_cost_at
from decode.prompt_lookup import lookup_draft

MAX_SIMULATED_K = 16


@dataclass
class TeacherForced:
    """What one teacher-forced drafter pass gives for one prompt.

    Attributes:
        prompt_id, category: the prompt's identity and category (for per-category figures).
        prompt: the prompt's token ids.
        answer: the target's answer ``(n,)`` token ids, ending with the EOS if one stopped it.
        draft_tokens: ``(n,)`` the drafter's argmax after prompt + ``answer[:t]``.
        draft_top_probs: ``(n,)`` its probability (softmax of the raw logits, as the decoder's greedy
            confidence threshold reads it).
        betas: ``(n,)`` 1 - TV(target, drafter) at each position (sampling); None for greedy.
    """

    prompt_id: str
    category: str
    prompt: list[int]
    answer: list[int]
    draft_tokens: list[int]
    draft_top_probs: list[float] | None = None
    betas: list[float] | None = None

    @property
    def matches(self) -> list[bool]:
        """``m[t]``: the drafter's argmax equals the target's token at answer position t."""
        return [d == a for d, a in zip(self.draft_tokens, self.answer)]

    def greedy_blocks(self, **settings) -> DecodeStats:
        """The greedy decoder's blocks on this prompt (:func:`simulate_greedy`'s keyword arguments)."""
        return simulate_greedy(self, **settings)

    def sampling_blocks(self, *, draft_length: int, max_new_tokens: int) -> BlockTotals:
        """Speculative sampling's expected totals along this answer (:func:`expected_sampling_blocks`)."""
        return expected_sampling_blocks(self.betas, draft_length=draft_length, max_new_tokens=max_new_tokens)


def _ends_with_eos(answer: Sequence[int], eos_token_ids: Sequence[int]) -> bool:
    return bool(answer) and answer[-1] in set(eos_token_ids)


def _check_answer(answer: Sequence[int], max_new_tokens: int) -> None:
    if len(answer) > max_new_tokens:
        raise ValueError(f"the answer has {len(answer)} tokens, more than max_new_tokens={max_new_tokens}")


def simulate_greedy(sample: TeacherForced, *, draft_length: int, max_new_tokens: int, schedule: str = "constant",
                    max_draft_length: int | None = None, confidence_threshold: float = 0.0) -> DecodeStats:
    """The blocks greedy ``speculative_generate`` makes on ``sample``'s prompt, from the teacher-forced pass.

    ``accepted_per_block`` equals the decoder's exactly when the pass's argmaxes are the decoder's (float32,
    no near-ties between a full forward and the incremental one). ``drafted_per_block`` too, but with a
    confidence threshold that ends a block only after its first rejection, where it counts the drafts up to
    that rejection (a lower bound). ``answer`` must be the whole greedy answer up to its EOS or to
    ``max_new_tokens``. Timings are 0.

    Raises:
        ValueError: an answer longer than ``max_new_tokens``, a threshold outside [0, 1), or a schedule error.
    """
    _check_answer(sample.answer, max_new_tokens)
    if not 0.0 <= confidence_threshold < 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
    if confidence_threshold > 0 and sample.draft_top_probs is None:
        raise ValueError("a confidence threshold needs the drafter's top probabilities (draft_top_probs)")
    plan = make_schedule(schedule, draft_length, max_draft_length)
    matches, n = sample.matches, len(sample.answer)
    stats = DecodeStats(draft_length=draft_length)
    p = 0
    while p < n:
        k = min(plan.next_length(), max_new_tokens - p - 1)
        accepted, drafted = 0, 0
        while drafted < k:  # the drafts that were fed the target's own tokens
            drafted += 1
            if p + accepted >= n or not matches[p + accepted]:
                break
            accepted += 1
            if confidence_threshold > 0 and sample.draft_top_probs[p + accepted - 1] < confidence_threshold:
                break
        plan.update(drafted, accepted)
        accepted = min(accepted, n - p - 1)  # a matched EOS is the block's +1
        stats.accepted_per_block.append(accepted)
        stats.drafted_per_block.append(drafted if confidence_threshold > 0 else k)
        p += accepted + 1
    stats.new_tokens = n
    stats.target_forwards = len(stats.accepted_per_block)
    return stats


def simulate_prompt_lookup(prompt: Sequence[int], answer: Sequence[int], *, draft_length: int, max_new_tokens: int,
                           max_ngram: int = 2, schedule: str = "constant",
                           max_draft_length: int | None = None) -> DecodeStats:
    """The blocks ``speculative_generate`` with a ``PromptLookupDrafter`` makes while emitting ``answer``
    (the target's greedy answer to ``prompt``): exact, no model needed.

    Raises:
        ValueError: an answer longer than ``max_new_tokens``, or a schedule error.
    """
    _check_answer(answer, max_new_tokens)
    plan = make_schedule(schedule, draft_length, max_draft_length)
    context, answer = list(prompt), list(answer)
    stats = DecodeStats(draft_length=draft_length)
    p, n = 0, len(answer)
    while p < n:
        k = min(plan.next_length(), max_new_tokens - p - 1)
        drafts = lookup_draft(context + answer[:p], k, max_ngram)
        accepted = 0
        while accepted < len(drafts) and p + accepted < n and drafts[accepted] == answer[p + accepted]:
            accepted += 1
        plan.update(len(drafts), accepted)
        accepted = min(accepted, n - p - 1)
        stats.accepted_per_block.append(accepted)
        stats.drafted_per_block.append(len(drafts))
        p += accepted + 1
    stats.new_tokens = n
    stats.target_forwards = len(stats.accepted_per_block)
    return stats


@dataclass
class BlockTotals:
    """One prompt's totals, counted (greedy, prompt lookup) or expected (speculative sampling).

    Attributes:
        tokens: answer length n (tokens emitted).
        blocks: target forwards (E[target forwards] for sampling).
        drafted: draft tokens proposed (expected for sampling).
    """

    tokens: float
    blocks: float
    drafted: float

    @property
    def accepted(self) -> float:
        """Draft tokens accepted and output: every block emits accepted + 1 tokens."""
        return self.tokens - self.blocks

    @classmethod
    def of(cls, stats: DecodeStats) -> BlockTotals:
        return cls(tokens=stats.new_tokens, blocks=len(stats.accepted_per_block), drafted=sum(stats.drafted_per_block))


def expected_sampling_blocks(betas: Sequence[float], *, draft_length: int, max_new_tokens: int) -> BlockTotals:
    """E[blocks] and E[drafted] of speculative sampling with K = ``draft_length`` along an answer whose
    per-position acceptance probabilities are ``betas`` (``(n,)``, ``beta_t = 1 - TV`` at position t).

    Draft j of a block starting at p is accepted with probability ``beta_{p+j}`` given drafts before it were
    (Leviathan et al. 2023, Sec. 3), so P(n accepted) = prod_{j<n} beta_{p+j} (1 - beta_{p+n}) for n < k and
    the product of all k for n = k. A dynamic programme from the answer's end gives the expectations. The
    last position's draft is capped as the decoder caps it (an accepted EOS is the block's +1).

    Raises:
        ValueError: an answer longer than ``max_new_tokens`` or a beta outside [0, 1].
    """
    _check_answer(betas, max_new_tokens)
    if any(not 0.0 <= b <= 1.0 + 1e-6 for b in betas):
        raise ValueError("betas must lie in [0, 1]")
    n = len(betas)
    blocks, drafted = [0.0] * (n + 1), [0.0] * (n + 1)  # expectations from each start position to the end
    for p in range(n - 1, -1, -1):
        k = min(draft_length, max_new_tokens - p - 1)
        survive, e_blocks, e_drafted = 1.0, 1.0, float(k)
        for accepted in range(k + 1):
            stop = 1.0 - betas[p + accepted] if accepted < k and p + accepted < n else 1.0
            prob = survive * stop
            nxt = min(p + accepted + 1, n)
            e_blocks += prob * blocks[nxt]
            e_drafted += prob * drafted[nxt]
            survive *= 1.0 - stop
            if p + accepted + 1 >= n:  # every longer run also ends the answer
                e_blocks += survive * blocks[n]
                e_drafted += survive * drafted[n]
                break
        blocks[p], drafted[p] = e_blocks, e_drafted
    return BlockTotals(tokens=n, blocks=blocks[0], drafted=drafted[0])


# --- figures over many prompts --------------------------------------------------------------------


def _ratio(numerators: Sequence[float], denominators: Sequence[float], rows: Sequence[int]) -> float:
    den = sum(denominators[i] for i in rows)
    return sum(numerators[i] for i in rows) / den if den else 0.0


def bootstrap_ci(statistic: Callable[..., float], num_items: int, *, resamples: int = 2000, seed: int = 0,
                 level: float = 0.95, rounds: Sequence[int] = ()) -> list[float]:
    """Percentile bootstrap interval ``[lo, hi]`` of ``statistic(rows)`` over ``num_items`` prompts resampled
    with replacement (Efron and Tibshirani 1993, ch. 13); seeded, so a report repeats.

    With ``rounds`` (the number of timing rounds of each independent cost measurement, e.g. ``(c rounds,
    verify rounds)``) each resample also draws every measurement's rounds with replacement and calls
    ``statistic(rows, *round_rows)``, so the interval covers the timing noise as well as the prompts drawn.

    Raises:
        ValueError: no items, a level outside (0, 1) or a measurement without rounds.
    """
    if num_items < 1 or not 0 < level < 1 or any(n < 1 for n in rounds):
        raise ValueError(f"bootstrap_ci needs items, rounds and a level in (0, 1), got {num_items}, {rounds}, {level}")
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(n) for _ in range(n)]

    values = sorted(statistic(draw(num_items), *(draw(n) for n in rounds)) for _ in range(resamples))
    return [values[int((1 - level) / 2 * (resamples - 1))], values[int(round((1 + level) / 2 * (resamples - 1)))]]


def _columns(totals: Sequence[BlockTotals]) -> tuple[list[float], list[float], list[float], list[float]]:
    return ([t.tokens for t in totals], [t.blocks for t in totals], [t.drafted for t in totals],
            [t.accepted for t in totals])


def figures(totals: Sequence[BlockTotals], *, intervals: bool = True, seed: int = 0) -> dict:
    """Pooled figures of prompts' blocks: ``num_prompts``, ``num_tokens``, ``acceptance_rate`` (accepted /
    drafted), ``mean_accepted_tokens`` (tau = tokens / target forwards, +1 included), ``mean_draft_length``
    and, with ``intervals``, ``ci95`` of the first two (bootstrap over prompts).

    Raises:
        ValueError: no prompts.
    """
    if not totals:
        raise ValueError("figures need at least one prompt")
    tokens, blocks, drafted, accepted = _columns(totals)
    every = range(len(totals))
    result = {"num_prompts": len(totals), "num_tokens": int(sum(tokens)),
              "acceptance_rate": _ratio(accepted, drafted, every), "mean_accepted_tokens": _ratio(tokens, blocks, every),
              "mean_draft_length": _ratio(drafted, blocks, every)}
    if intervals:
        result["ci95"] = {
            "acceptance_rate": bootstrap_ci(lambda rows: _ratio(accepted, drafted, rows), len(totals), seed=seed),
            "mean_accepted_tokens": bootstrap_ci(lambda rows: _ratio(tokens, blocks, rows), len(totals), seed=seed)}
    return result


def paired_tau_difference(totals_a: Sequence[BlockTotals], totals_b: Sequence[BlockTotals], *, seed: int = 0) -> dict:
    """tau(a) - tau(b) on the same prompts (pooled tau each), with its paired 95% bootstrap interval:
    ``{"mean_accepted_tokens": d, "ci95": [lo, hi]}``; an interval that excludes 0 separates the drafters.

    Raises:
        ValueError: the two lists cover different numbers of prompts.
    """
    if len(totals_a) != len(totals_b):
        raise ValueError(f"paired difference over different prompt counts ({len(totals_a)} vs {len(totals_b)})")
    tokens_a, blocks_a, _, _ = _columns(totals_a)
    tokens_b, blocks_b, _, _ = _columns(totals_b)

    def difference(rows):
        return _ratio(tokens_a, blocks_a, rows) - _ratio(tokens_b, blocks_b, rows)

    return {"mean_accepted_tokens": difference(range(len(totals_a))),
            "ci95": bootstrap_ci(difference, len(totals_a), seed=seed)}


@dataclass(frozen=True)
class DrafterCosts:
    """The cost model's inputs for one drafter at one K, in one-token target forwards, with the timing rounds
    behind them when they were measured (to resample in a bootstrap; empty: held fixed).

    Attributes:
        cost_ratio: c, the drafter's one-token forward time over the target's (the median of its rounds).
        verify_cost: the target's forward over K + 1 tokens (``decode.metrics.verify_cost_at``).
        cost_ratio_rounds: ``(rounds,)`` c of each interleaved round (``decode.costs.measure_cost_ratios``).
        verify_cost_rounds: ``(rounds,)`` the verify cost at this K of each round, on ``verify_cost``'s scale.
    """

    cost_ratio: float
    verify_cost: float
    cost_ratio_rounds: tuple[float, ...] = ()
    verify_cost_rounds: tuple[float, ...] = ()

    @property
    def rounds(self) -> tuple[int, ...]:
        """The round counts :func:`bootstrap_ci` draws for these costs: ``(c rounds, verify rounds)``, either 1
        when not measured (one fixed value)."""
        return len(self.cost_ratio_rounds) or 1, len(self.verify_cost_rounds) or 1

    def resampled(self, c_rows: Sequence[int], verify_rows: Sequence[int]) -> DrafterCosts:
        """The costs of one bootstrap resample: the medians of the rounds drawn (the value held where no rounds)."""
        c = statistics.median(self.cost_ratio_rounds[i] for i in c_rows) if self.cost_ratio_rounds else self.cost_ratio
        v = (statistics.median(self.verify_cost_rounds[i] for i in verify_rows) if self.verify_cost_rounds
             else self.verify_cost)
        return DrafterCosts(c, v)


def drafter_costs(cost_ratio: float, verify_costs: Sequence[float] | None, draft_length: int, *,
                  cost_ratio_rounds: Sequence[float] = (),
                  verify_cost_rounds: Sequence[Sequence[float]] = ()) -> DrafterCosts:
    """:class:`DrafterCosts` at K = ``draft_length`` from c, the (smoothed) verification costs by length and
    the rounds behind them (``(rounds,)`` c, ``(rounds, lengths)`` raw verification costs). Each round's
    verification cost is scaled by smoothed / raw median at this K, so the rounds carry their spread around
    the smoothed value the point estimate uses."""
    verify = verify_cost_at(verify_costs, draft_length)
    at_k = [verify_cost_at(r, draft_length) for r in verify_cost_rounds]
    if at_k:
        scale = verify / statistics.median(at_k)
        at_k = [v * scale for v in at_k]
    return DrafterCosts(cost_ratio, verify, tuple(cost_ratio_rounds), tuple(at_k))


def _predicted_speedup(totals: Sequence[BlockTotals], costs: DrafterCosts, rows: Sequence[int]) -> float:
    """tokens / (drafted x c + blocks x verify cost), pooled over ``rows``: the per-prompt form of
    :func:`decode.metrics.predicted_speedup` (tau / (mean K c + verify cost) with tau = tokens / blocks)."""
    tokens = sum(totals[i].tokens for i in rows)
    cost = sum(totals[i].drafted * costs.cost_ratio + totals[i].blocks * costs.verify_cost for i in rows)
    return tokens / cost if cost else 0.0


def predicted_speedup_ci(totals: Sequence[BlockTotals], costs: DrafterCosts, *, seed: int = 0) -> list[float]:
    """95% interval of the pooled predicted speedup (:func:`_predicted_speedup`) resampling the prompts and the
    costs' timing rounds together (prompts alone where ``costs`` carry no rounds)."""
    return bootstrap_ci(lambda rows, c_rows, v_rows: _predicted_speedup(totals, costs.resampled(c_rows, v_rows), rows),
                        len(totals), seed=seed, rounds=costs.rounds)


def paired_speedup_ratio(totals_a: Sequence[BlockTotals], costs_a: DrafterCosts, totals_b: Sequence[BlockTotals],
                         costs_b: DrafterCosts, *, seed: int = 0) -> dict:
    """Predicted speedup of drafter a over drafter b on the same prompts, each at its own K and costs:
    ``{"ratio": S_a / S_b, "ci95": [lo, hi], "ci95_prompts_only": [lo, hi], "interval_covers": ...}``.

    ``ci95`` is a paired bootstrap that resamples the prompts and the timing rounds together: the two
    drafters' c were timed in the same interleaved rounds (``decode.costs.measure_cost_ratios``), so one draw
    of round indices serves both, and their verification costs are the same target's. So the interval covers
    the timing noise of c as well as which prompts were drawn; ``ci95_prompts_only`` holds the costs fixed (the
    prompts' share of it). A ratio of 1.10 is a 10% faster decoder; an interval above 1 separates the two.

    Raises:
        ValueError: the two lists cover different numbers of prompts or none, or the two costs' rounds differ
            in number (they were not timed side by side).
    """
    if len(totals_a) != len(totals_b) or not totals_a:
        raise ValueError(f"paired ratio over different or no prompts ({len(totals_a)} vs {len(totals_b)})")
    rounds = tuple(max(a, b) for a, b in zip(costs_a.rounds, costs_b.rounds))
    for costs in (costs_a, costs_b):
        if any(n not in (1, m) for n, m in zip(costs.rounds, rounds)):
            raise ValueError(f"paired ratio of costs timed in different rounds ({costs_a.rounds} vs {costs_b.rounds})")

    def ratio(rows, c_rows=(), v_rows=()):
        a, b = costs_a, costs_b
        if c_rows:
            a, b = a.resampled(c_rows, v_rows), b.resampled(c_rows, v_rows)
        base = _predicted_speedup(totals_b, b, rows)
        return _predicted_speedup(totals_a, a, rows) / base if base else 0.0

    timed = rounds != (1, 1)
    return {"ratio": ratio(range(len(totals_a))),
            "ci95": bootstrap_ci(ratio, len(totals_a), seed=seed, rounds=rounds),
            "ci95_prompts_only": bootstrap_ci(ratio, len(totals_a), seed=seed),
            "interval_covers": "prompts and timing rounds" if timed else "prompts (costs held fixed)"}


# --- one drafter's simulated section of a report ----------------------------------------------------


@dataclass(frozen=True)
class SimulationSettings:
    """The decoder settings a simulation replays (as ``speculative_generate`` takes them).

    Attributes:
        draft_length: K (the starting K of the heuristic schedule).
        max_new_tokens: the decoder's limit; answers must not be longer.
        schedule: ``constant`` or ``heuristic``.
        max_draft_length: the heuristic schedule's cap (None = uncapped).
        confidence_threshold: greedy only (0 = off).
        sampling: True when the samples carry betas (temperature > 0): expected figures, constant K only.
    """

    draft_length: int
    max_new_tokens: int
    schedule: str = "constant"
    max_draft_length: int | None = None
    confidence_threshold: float = 0.0
    sampling: bool = False


def simulate(samples: Sequence[TeacherForced], settings: SimulationSettings, *, lookup_ngram: int | None = None,
             draft_length: int | None = None, schedule: str | None = None) -> list[DecodeStats | BlockTotals]:
    """Per prompt, the decoder's blocks at ``settings`` (or another ``draft_length`` / ``schedule``):
    ``DecodeStats`` for greedy model drafters and prompt lookup (``lookup_ngram`` = its max n-gram),
    ``BlockTotals`` of expectations for speculative sampling.

    Raises:
        ValueError: sampling with a heuristic schedule, a confidence threshold or prompt lookup (not simulated).
    """
    k = draft_length or settings.draft_length
    schedule = schedule or settings.schedule
    if settings.sampling:
        if schedule != "constant" or settings.confidence_threshold > 0 or lookup_ngram is not None:
            raise ValueError("speculative sampling is simulated for a constant K and model drafters only")
        return [s.sampling_blocks(draft_length=k, max_new_tokens=settings.max_new_tokens) for s in samples]
    if lookup_ngram is not None:
        return [simulate_prompt_lookup(s.prompt, s.answer, draft_length=k, max_new_tokens=settings.max_new_tokens,
                                       max_ngram=lookup_ngram, schedule=schedule,
                                       max_draft_length=settings.max_draft_length) for s in samples]
    return [s.greedy_blocks(draft_length=k, max_new_tokens=settings.max_new_tokens, schedule=schedule,
                            max_draft_length=settings.max_draft_length,
                            confidence_threshold=settings.confidence_threshold) for s in samples]


def _totals(results: Sequence[DecodeStats | BlockTotals]) -> list[BlockTotals]:
    return [r if isinstance(r, BlockTotals) else BlockTotals.of(r) for r in results]


def block_totals(samples: Sequence[TeacherForced], settings: SimulationSettings, *, draft_length: int,
                 lookup_ngram: int | None = None) -> list[BlockTotals]:
    """Per prompt, the simulated totals at a constant K = ``draft_length`` (what ``per_k`` pools)."""
    at_k = dataclasses.replace(settings, schedule="constant", max_draft_length=None)  # a cap is the heuristic's
    return _totals(simulate(samples, at_k, lookup_ngram=lookup_ngram, draft_length=draft_length))


def simulated_section(samples: Sequence[TeacherForced], settings: SimulationSettings, *,
                      cost_ratio: float | None = None, verify_costs: Sequence[float] | None = None,
                      lookup_ngram: int | None = None, max_k: int = MAX_SIMULATED_K, seed: int = 0,
                      cost_ratio_rounds: Sequence[float] = (),
                      verify_cost_rounds: Sequence[Sequence[float]] = ()) -> tuple[dict, list[BlockTotals]]:
    """A report's ``simulated`` entry for one drafter, and the per-prompt totals behind it (for pairing).

    The entry: ``num_prompts``, ``num_tokens``, ``draft_length``, ``schedule``, ``acceptance_rate``,
    ``mean_accepted_tokens`` (tau), ``mean_draft_length``, ``ci95`` (bootstrap over prompts),
    ``per_position_acceptance`` and ``top1_agreement`` (greedy: the share of answer positions where the
    drafter's argmax is the target's token, model drafters only), ``per_k`` ({"1".."16": acceptance_rate, mean_accepted_tokens,
    predicted_speedup}), ``heuristic`` (greedy: transformers' schedule started at K), ``per_category``
    ({category: the pooled figures with intervals}), and ``recommended_draft_length`` (the K of the highest
    predicted speedup, whose interval is ``ci95["predicted_speedup_at_best_k"]``: prompts and the timing rounds
    ``cost_ratio_rounds`` / ``verify_cost_rounds`` resampled together, :func:`predicted_speedup_ci`).
    ``predicted_speedup`` = :func:`decode.metrics.predicted_speedup` with the measured ``cost_ratio`` c and
    ``verify_costs`` (None without them). For speculative sampling (``settings.sampling``)
    every figure is an expectation along target-sampled answers.

    Raises:
        ValueError: no samples, or what :func:`simulate` refuses.
    """
    from decode.metrics import predicted_speedup

    if not samples:
        raise ValueError("simulated_section needs at least one prompt")
    results = simulate(samples, settings, lookup_ngram=lookup_ngram)
    totals = _totals(results)
    section = {**figures(totals, seed=seed), "draft_length": settings.draft_length, "schedule": settings.schedule,
               "kind": "expected (speculative sampling, along target-sampled answers)" if settings.sampling
               else "exact (greedy)"}
    if settings.confidence_threshold > 0:
        section["note"] = ("with a confidence threshold, drafts after a block's first rejection are not simulated: "
                           "drafted counts are lower bounds there, so acceptance_rate is an upper bound and "
                           "predicted speedups lean optimistic; tau is exact")
    if not settings.sampling:
        section["per_position_acceptance"] = DecodeStats.merge(list(results)).per_position_acceptance
        if lookup_ngram is None:  # the ceiling of greedy acceptance: the share of positions the drafter gets right
            matched = sum(sum(s.matches) for s in samples)
            section["top1_agreement"] = matched / max(1, sum(len(s.answer) for s in samples))
    per_k, totals_at = {}, {}
    for k in range(1, max_k + 1):
        totals_at[k] = block_totals(samples, settings, draft_length=k, lookup_ngram=lookup_ngram)
        pooled = figures(totals_at[k], intervals=False)
        speedup = (predicted_speedup(pooled["mean_accepted_tokens"], pooled["mean_draft_length"], cost_ratio,
                                     verify_cost_at(verify_costs, k)) if cost_ratio is not None else None)
        per_k[str(k)] = {"acceptance_rate": pooled["acceptance_rate"],
                         "mean_accepted_tokens": pooled["mean_accepted_tokens"], "predicted_speedup": speedup}
    section["per_k"] = per_k
    if cost_ratio is not None:
        best = int(max(per_k, key=lambda k: (per_k[k]["predicted_speedup"], -int(k))))
        section["recommended_draft_length"] = best
        costs = drafter_costs(cost_ratio, verify_costs, best, cost_ratio_rounds=cost_ratio_rounds,
                              verify_cost_rounds=verify_cost_rounds)
        section["ci95"]["predicted_speedup_at_best_k"] = predicted_speedup_ci(totals_at[best], costs, seed=seed)
    if not settings.sampling:
        heuristic = figures(_totals(simulate(samples, settings, lookup_ngram=lookup_ngram, schedule="heuristic")),
                            intervals=False)
        section["heuristic"] = {key: heuristic[key] for key in
                                ("acceptance_rate", "mean_accepted_tokens", "mean_draft_length")}
    section["per_category"] = {
        category: figures([t for t, s in zip(totals, samples) if s.category == category], seed=seed)
        for category in sorted({s.category for s in samples})}
    return section, totals
