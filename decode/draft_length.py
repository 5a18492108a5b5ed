"""How many tokens to draft per block: fixed, adaptive schedules, and K chosen from measurements.

Schedules are small stateful objects that ``speculative_generate`` asks for the
next draft length and tells the outcome of each block; a new one is made per
generation.

* ``constant``: K every block.
* ``heuristic``: transformers' ``num_assistant_tokens_schedule="heuristic"``
  (assisted generation): K + 2 after a fully accepted block, max(1, K - 1)
  otherwise, starting from K, optionally capped.

``choose_draft_length`` picks K from the acceptance measured per draft
position, the cost ratio c and (on CPUs, where verifying K + 1 tokens is not
free) the measured cost of a verification forward, generalising Leviathan et
al. 2023, Theorem 3.8 from an i.i.d. alpha to per-position acceptance.
``rule_of_thumb_draft_length`` is the source article's K = accuracy x 5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decode.metrics import verify_cost_at

SCHEDULES = ("constant", "heuristic")


class ConstantSchedule:
    """Draft ``draft_length`` tokens every block."""

    def __init__(self, draft_length: int):
        self.draft_length = draft_length

    def next_length(self) -> int:
        return self.draft_length

    def update(self, drafted: int, accepted: int) -> None:
        pass


class HeuristicSchedule:
    """transformers' heuristic: K += 2 after a fully accepted block, else K = max(1, K - 1).

    Same rule as ``AssistedCandidateGenerator.update_candidate_strategy`` in
    transformers 5 (``num_assistant_tokens_schedule="heuristic"``); ``max_length``
    caps K (None = uncapped, as in transformers).
    """

    def __init__(self, draft_length: int, max_length: int | None = None):
        self.draft_length, self.max_length = draft_length, max_length

    def next_length(self) -> int:
        return self.draft_length

    def update(self, drafted: int, accepted: int) -> None:
        # as transformers: only a block that accepted all K requested drafts grows K
        if accepted >= self.draft_length:
            self.draft_length += 2
            if self.max_length is not None:
                self.draft_length = min(self.draft_length, self.max_length)
        else:
            self.draft_length = max(1, self.draft_length - 1)


def make_schedule(name: str, draft_length: int, max_draft_length: int | None = None):
    """A fresh schedule object by name (``constant`` or ``heuristic``).

    Raises:
        ValueError: unknown name, draft_length < 1 or max_draft_length < draft_length.
    """
    if draft_length < 1:
        raise ValueError(f"draft_length must be >= 1, got {draft_length}")
    if max_draft_length is not None and max_draft_length < draft_length:
        raise ValueError(f"max_draft_length ({max_draft_length}) must be >= draft_length ({draft_length})")
    if name == "constant":
        return ConstantSchedule(draft_length)
    if name == "heuristic":
        return HeuristicSchedule(draft_length, max_draft_length)
    raise ValueError(f"unknown draft schedule {name!r}: choose one of {', '.join(SCHEDULES)}")


def _filled(per_position_acceptance: Sequence[float | None], max_k: int) -> list[float]:
    """Per-position acceptance for positions 1..max_k: gaps and unmeasured positions get the mean measured value."""
    measured = [a for a in per_position_acceptance if a is not None]
    fill = sum(measured) / len(measured) if measured else 0.0
    values = [fill if a is None else a for a in per_position_acceptance[:max_k]]
    return values + [fill] * (max_k - len(values))


def expected_tokens_per_block(per_position_acceptance: Sequence[float | None], draft_length: int) -> float:
    """Expected tokens per target forward with K drafts: 1 + sum_{i=1..K} prod_{j<=i} a_j.

    ``a_j`` is P(draft j accepted | drafts 1..j-1 accepted). With a constant
    a_j = alpha this is Leviathan et al. 2023, Eq. 1, (1 - alpha^(K+1)) / (1 - alpha).
    Positions not measured (None, or beyond the list) take the mean of the measured ones.
    """
    total, survive = 1.0, 1.0
    for a in _filled(per_position_acceptance, draft_length):
        survive *= a
        total += survive
    return total


def expected_speedup(per_position_acceptance: Sequence[float | None], draft_length: int, cost_ratio: float,
                     verify_cost: float = 1.0) -> float:
    """Expected speedup over the target alone: E[tokens per block] / (K c + verify_cost).

    Leviathan et al. 2023, Theorem 3.8, with per-position acceptance instead
    of an i.i.d. alpha, and ``verify_cost`` = time of one target forward over
    K + 1 tokens in units of a 1-token target forward (1.0 in the paper, which
    assumes verification is as cheap as one decoding step, as on a GPU).
    """
    return expected_tokens_per_block(per_position_acceptance, draft_length) / (draft_length * cost_ratio + verify_cost)


def rule_of_thumb_draft_length(accuracy: float) -> int:
    """The source article's heuristic, K = max(2, int(accuracy * 5)), with ``accuracy`` the drafter's top-1 agreement."""
    return max(2, int(accuracy * 5))


@dataclass
class DraftLengthChoice:
    """K chosen from measurements, with the figures behind it.

    Attributes:
        best_draft_length: K maximising ``expected_speedup``.
        expected_speedup_by_k: {K: expected speedup} for K = 1..max_k.
        rule_of_thumb: the article's K = max(2, int(accuracy * 5)), for comparison.
        cost_ratio: c used.
        verify_costs: {K: target forward over K + 1 tokens / 1-token forward} used (1.0 where not measured).
        speculation_pays: whether the best expected speedup exceeds 1.
    """

    best_draft_length: int
    expected_speedup_by_k: dict[int, float]
    rule_of_thumb: int
    cost_ratio: float
    verify_costs: dict[int, float]
    speculation_pays: bool


def choose_draft_length(per_position_acceptance: Sequence[float | None], cost_ratio: float, *,
                        accuracy: float, verify_costs: Sequence[float] | None = None,
                        max_k: int = 8) -> DraftLengthChoice:
    """Pick K in 1..max_k maximising ``expected_speedup`` (smallest K on ties).

    Args:
        per_position_acceptance: P(position i accepted | earlier accepted), i = 0.., as measured
            by ``DecodeStats.per_position_acceptance`` (None = never reached).
        cost_ratio: c = drafter / target 1-token forward time.
        accuracy: the drafter's top-1 agreement (the acceptance rate, greedy), for the rule of thumb.
        verify_costs: ``verify_costs[n - 1]`` = target forward over n tokens / 1-token forward,
            n = 1..; positions past the list repeat its last growth step; None = 1.0 for all (Thm 3.8).
        max_k: largest K considered.

    Raises:
        ValueError: max_k < 1 or cost_ratio < 0.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    costs = {k: verify_cost_at(verify_costs, k) for k in range(1, max_k + 1)}
    by_k = {k: expected_speedup(per_position_acceptance, k, cost_ratio, costs[k]) for k in costs}
    best = max(by_k, key=lambda k: (by_k[k], -k))
    return DraftLengthChoice(best, by_k, rule_of_thumb_draft_length(accuracy), cost_ratio, costs, by_k[best] > 1.0)
