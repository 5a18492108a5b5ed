"""Acceptance statistics and the theoretical speedup of speculative decoding.

Conventions (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Sec. 3):

* A *block* is one target verification forward. It checks ``K`` drafted
  tokens (``K`` = ``draft_length``, fewer near ``max_new_tokens``), accepts
  ``n`` of them (0..K) and always emits one more token from the target (the
  correction after a rejection, or the bonus after full acceptance). So a
  block emits ``n + 1`` tokens; this ``+1`` is counted in
  ``mean_accepted_tokens`` (block efficiency, tau) but not in
  ``acceptance_rate``.
* ``alpha`` is the per-token acceptance probability of the i.i.d. model of
  the paper; ``c`` the cost ratio (drafter forward time / target forward time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Statistics returned with the tokens of one generation (or merged over several).

    Attributes:
        draft_length: K requested per block (0 for target-only decoding).
        accepted_per_block: draft tokens accepted and output at each target
            forward (0..K). A block cut by an EOS or a stop string counts the
            drafts before the stopping token, which is the block's +1: so
            ``sum(accepted + 1) == new_tokens`` for every generation.
        drafted_per_block: draft tokens proposed at each target forward (K, or
            fewer where ``max_new_tokens`` was near).
        target_forwards: target forwards after the prompt prefill.
        draft_forwards: drafter forwards after the prompt prefill.
        new_tokens: tokens emitted (EOS included if it ended the output).
        prefill_s: seconds spent on the prompt (both models).
        decode_s: seconds spent emitting ``new_tokens`` (prefill excluded).
    """

    draft_length: int
    accepted_per_block: list[int] = field(default_factory=list)
    drafted_per_block: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens, in [0, 1]; 0.0 if nothing was drafted.

        Drafts after the first rejection in a block count as drafted and not
        accepted (the usual "acceptance rate" of HF and vLLM reports).
        """
        drafted = sum(self.drafted_per_block)
        return sum(self.accepted_per_block) / drafted if drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per target forward, tau = mean(accepted + 1); 0.0 without blocks.

        The ``+1`` is the correction or bonus token every verification emits
        (block efficiency, Leviathan et al. 2023 Eq. 1). Target-only decoding
        has tau = 1; a perfect drafter has tau = K + 1.
        """
        blocks = len(self.accepted_per_block)
        return (sum(self.accepted_per_block) + blocks) / blocks if blocks else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability: accepted / positions verified before a rejection.

        The maximum-likelihood estimate of Leviathan et al.'s alpha under their
        i.i.d. assumption: a block with ``n < K`` accepted reached ``n + 1``
        positions, one with ``n == K`` reached K. 0.0 if nothing was drafted.
        """
        reached = sum(min(a + 1, d) for a, d in zip(self.accepted_per_block, self.drafted_per_block))
        return sum(self.accepted_per_block) / reached if reached else 0.0

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """P(draft position i accepted | positions 0..i-1 accepted), i = 0..max(K, longest block)-1.

        ``None`` where position i was never reached (no block drafted that far
        with all earlier drafts accepted).
        """
        result: list[float | None] = []
        for i in range(max(self.draft_length, max(self.drafted_per_block, default=0))):  # adaptive K may exceed it
            reached = sum(1 for a, d in zip(self.accepted_per_block, self.drafted_per_block) if d > i and a >= i)
            accepted = sum(1 for a in self.accepted_per_block if a > i)
            result.append(accepted / reached if reached else None)
        return result

    @property
    def mean_draft_length(self) -> float:
        """Draft tokens proposed per block (K for a constant schedule away from ``max_new_tokens``); 0.0 without blocks."""
        blocks = len(self.drafted_per_block)
        return sum(self.drafted_per_block) / blocks if blocks else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decode time (prefill excluded); 0.0 if no time was spent."""
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @classmethod
    def merge(cls, stats_list: list[DecodeStats]) -> DecodeStats:
        """Pool several generations: block lists concatenated, counts and seconds summed.

        Raises:
            ValueError: empty list, or different ``draft_length`` values.
        """
        if not stats_list:
            raise ValueError("merge needs at least one DecodeStats")
        lengths = {s.draft_length for s in stats_list}
        if len(lengths) > 1:
            raise ValueError(f"cannot merge stats with different draft lengths {sorted(lengths)}")
        return cls(
            draft_length=stats_list[0].draft_length,
            accepted_per_block=[a for s in stats_list for a in s.accepted_per_block],
            drafted_per_block=[d for s in stats_list for d in s.drafted_per_block],
            target_forwards=sum(s.target_forwards for s in stats_list),
            draft_forwards=sum(s.draft_forwards for s in stats_list),
            new_tokens=sum(s.new_tokens for s in stats_list),
            prefill_s=sum(s.prefill_s for s in stats_list),
            decode_s=sum(s.decode_s for s in stats_list),
        )


def _check(alpha: float, draft_length: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if draft_length < 0:
        raise ValueError(f"draft_length must be >= 0, got {draft_length}")


def expected_tokens_per_forward(alpha: float, draft_length: int) -> float:
    """Expected tokens per target forward, (1 - alpha^(K+1)) / (1 - alpha).

    Leviathan et al. 2023, Eq. 1; equals K + 1 at alpha = 1.

    Raises:
        ValueError: alpha outside [0, 1] or draft_length < 0.
    """
    _check(alpha, draft_length)
    if alpha == 1.0:
        return float(draft_length + 1)
    return (1.0 - alpha ** (draft_length + 1)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, draft_length: int, cost_ratio: float) -> float:
    """Expected walltime improvement, (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)).

    Leviathan et al. 2023, Theorem 3.8: tokens per target forward divided by
    the cost of one block (K drafter forwards at ``c`` each plus one target
    forward), assuming verification of K+1 tokens costs one target forward.
    At alpha = 1 it is (K + 1) / (K c + 1).

    Args:
        alpha: per-token acceptance probability in [0, 1].
        draft_length: K >= 0.
        cost_ratio: c >= 0, drafter forward time / target forward time.

    Raises:
        ValueError: arguments out of range.
    """
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return expected_tokens_per_forward(alpha, draft_length) / (draft_length * cost_ratio + 1.0)


def verify_cost_at(verify_costs: Sequence[float] | None, draft_length: int) -> float:
    """Cost of verifying K + 1 tokens in 1-token target forwards, from ``verify_costs[n - 1]`` (n tokens,
    as ``decode.costs.measure_verify_costs`` measures them); beyond the list, extended linearly from its
    last two entries; 1.0 (Leviathan et al.'s free verification) without measurements."""
    if not verify_costs:
        return 1.0
    if draft_length < len(verify_costs):
        return float(verify_costs[draft_length])
    step = verify_costs[-1] - verify_costs[-2] if len(verify_costs) > 1 else 0.0
    return float(verify_costs[-1] + step * (draft_length + 1 - len(verify_costs)))


def predicted_speedup(tau: float, mean_draft_length: float, cost_ratio: float, verify_cost: float) -> float:
    """Speedup over the target alone from blocks' tau and measured costs: tau / (mean K x c + verify_cost).

    Leviathan et al. 2023, Theorem 3.8, with tau counted (or simulated) instead of derived from an i.i.d.
    alpha, and the measured cost of a (K+1)-token verification in 1-token forwards instead of 1.
    """
    return tau / (mean_draft_length * cost_ratio + verify_cost)
