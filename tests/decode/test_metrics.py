"""decode.metrics: acceptance statistics and Leviathan et al. 2023 formulas against hand-computed values."""

import pytest

from decode.metrics import DecodeStats, expected_tokens_per_forward, theoretical_speedup


@pytest.fixture
def stats():
    # K = 3; the last block was cut to 2 drafts by max_new_tokens.
    return DecodeStats(draft_length=3, accepted_per_block=[3, 0, 1, 2], drafted_per_block=[3, 3, 3, 2],
                       target_forwards=4, draft_forwards=11, new_tokens=10, prefill_s=0.5, decode_s=2.0)


def test_acceptance_rate(stats):
    assert stats.acceptance_rate == pytest.approx(6 / 11)


def test_mean_accepted_tokens_counts_the_bonus_token(stats):
    assert stats.mean_accepted_tokens == pytest.approx((6 + 4) / 4)


def test_alpha_counts_verified_positions(stats):
    # positions reached before a rejection: 3 (all accepted), 1, 2, 2 (all accepted) -> 6 / 8
    assert stats.alpha == pytest.approx(6 / 8)


def test_per_position_acceptance(stats):
    # position 0: reached 4, accepted 3; position 1: reached 3 (blocks 0, 2, 3), accepted 2;
    # position 2: reached 1 (block 3 drafted only 2), accepted 1
    assert stats.per_position_acceptance == pytest.approx([3 / 4, 2 / 3, 1.0])
    never = DecodeStats(draft_length=2, accepted_per_block=[0, 0], drafted_per_block=[2, 2])
    assert never.per_position_acceptance == [0.0, None]


def test_tokens_per_s(stats):
    assert stats.tokens_per_s == pytest.approx(5.0)
    assert DecodeStats(draft_length=1).tokens_per_s == 0.0


def test_empty_stats_are_zero():
    empty = DecodeStats(draft_length=4)
    assert (empty.acceptance_rate, empty.mean_accepted_tokens, empty.alpha) == (0.0, 0.0, 0.0)
    assert empty.per_position_acceptance == [None] * 4


def test_merge(stats):
    other = DecodeStats(draft_length=3, accepted_per_block=[0], drafted_per_block=[3], target_forwards=1,
                        draft_forwards=3, new_tokens=1, prefill_s=0.25, decode_s=1.0)
    merged = DecodeStats.merge([stats, other])
    assert merged.accepted_per_block == [3, 0, 1, 2, 0]
    assert merged.drafted_per_block == [3, 3, 3, 2, 3]
    assert (merged.target_forwards, merged.draft_forwards, merged.new_tokens) == (5, 14, 11)
    assert (merged.prefill_s, merged.decode_s) == pytest.approx((0.75, 3.0))
    assert merged.acceptance_rate == pytest.approx(6 / 14)


def test_merge_rejects_mixed_or_empty():
    with pytest.raises(ValueError):
        DecodeStats.merge([])
    with pytest.raises(ValueError):
        DecodeStats.merge([DecodeStats(draft_length=2), DecodeStats(draft_length=3)])


def test_expected_tokens_per_forward():
    assert expected_tokens_per_forward(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_forward(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    assert expected_tokens_per_forward(1.0, 5) == 6.0
    assert expected_tokens_per_forward(0.0, 5) == 1.0


def test_theoretical_speedup_hand_computed():
    # (1 - 0.8^5) / ((1 - 0.8)(4 * 0.1 + 1)) = 3.3616 / 1.4
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx(2.4011428571)
    # alpha = 1: (K + 1) / (K c + 1) = 4 / 2.5
    assert theoretical_speedup(1.0, 3, 0.5) == pytest.approx(1.6)
    # alpha = 0: only the target's own token, K c of drafting wasted
    assert theoretical_speedup(0.0, 2, 0.25) == pytest.approx(1 / 1.5)
    # free drafter: speedup = expected tokens per forward
    assert theoretical_speedup(0.6, 3, 0.0) == pytest.approx(1 + 0.6 + 0.36 + 0.216)


def test_theoretical_speedup_is_continuous_at_alpha_one():
    assert theoretical_speedup(1 - 1e-9, 7, 0.2) == pytest.approx(theoretical_speedup(1.0, 7, 0.2), rel=1e-6)


@pytest.mark.parametrize("args", [(-0.1, 3, 0.1), (1.1, 3, 0.1), (0.5, -1, 0.1), (0.5, 3, -0.1)])
def test_theoretical_speedup_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        theoretical_speedup(*args)


def test_theoretical_speedup_peaks_at_an_interior_k():
    # alpha 0.8, c 0.1, K = 5, 6, 7: 3.68928 / 1.5, 3.951424 / 1.6, 4.1611392 / 1.7
    speedups = [theoretical_speedup(0.8, k, 0.1) for k in (5, 6, 7)]
    assert speedups == pytest.approx([2.45952, 2.46964, 2.447729], abs=1e-5)
