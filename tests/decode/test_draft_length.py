"""decode.draft_length: schedules and the choice of K from measured figures."""

import pytest

from decode.draft_length import (
    ConstantSchedule,
    HeuristicSchedule,
    choose_draft_length,
    expected_speedup,
    expected_tokens_per_block,
    make_schedule,
    rule_of_thumb_draft_length,
)
from decode.metrics import expected_tokens_per_forward, theoretical_speedup


def test_constant_schedule_never_changes():
    schedule = ConstantSchedule(3)
    for drafted, accepted in [(3, 3), (3, 0), (2, 1)]:
        schedule.update(drafted, accepted)
        assert schedule.next_length() == 3


def test_heuristic_schedule_follows_transformers_rule():
    schedule = HeuristicSchedule(3)
    schedule.update(3, 3)  # all accepted: +2
    assert schedule.next_length() == 5
    schedule.update(5, 2)  # a rejection: -1
    assert schedule.next_length() == 4
    for _ in range(10):
        schedule.update(schedule.next_length(), 0)
    assert schedule.next_length() == 1  # never below 1
    capped = HeuristicSchedule(3, max_length=6)
    for _ in range(5):
        capped.update(capped.next_length(), capped.next_length())
    assert capped.next_length() == 6


def test_make_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown draft schedule"):
        make_schedule("adaptive", 3)
    with pytest.raises(ValueError, match="draft_length"):
        make_schedule("constant", 0)
    with pytest.raises(ValueError, match="max_draft_length"):
        make_schedule("heuristic", 4, max_draft_length=2)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_constant_per_position_acceptance_reduces_to_leviathan(alpha, k):
    """With a_i = alpha for all i: Eq. 1 and Thm 3.8 of Leviathan et al. 2023."""
    assert expected_tokens_per_block([alpha] * k, k) == pytest.approx(expected_tokens_per_forward(alpha, k))
    assert expected_speedup([alpha] * k, k, 0.2) == pytest.approx(theoretical_speedup(alpha, k, 0.2))


def test_expected_tokens_hand_computed():
    # 1 + 0.9 + 0.9*0.5 + 0.9*0.5*0.2
    assert expected_tokens_per_block([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    # unmeasured positions take the mean of the measured ones (0.7)
    assert expected_tokens_per_block([0.9, None, 0.5], 3) == pytest.approx(1 + 0.9 + 0.63 + 0.315)
    assert expected_tokens_per_block([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.45 * 0.7)


def test_choose_draft_length_trades_acceptance_for_cost():
    per_position = [0.9] * 8
    free = choose_draft_length(per_position, 0.05, accuracy=0.9)
    assert free.best_draft_length == 8 and free.speculation_pays  # cheap drafter, free verification: draft far
    costly = choose_draft_length(per_position, 0.05, accuracy=0.9, verify_costs=[1.0 + 0.3 * n for n in range(9)])
    assert costly.best_draft_length < free.best_draft_length  # paying for each verified token shortens K
    assert costly.verify_costs[2] == pytest.approx(1.6)  # K = 2 verifies 3 tokens: verify_costs[3 - 1]
    hopeless = choose_draft_length([0.05] * 8, 0.5, accuracy=0.05)
    assert hopeless.best_draft_length == 1 and not hopeless.speculation_pays
    assert set(free.expected_speedup_by_k) == set(range(1, 9))


def test_choose_draft_length_extrapolates_verify_costs():
    choice = choose_draft_length([0.8] * 4, 0.1, accuracy=0.8, verify_costs=[1.0, 1.1, 1.2], max_k=4)
    assert choice.verify_costs == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4})


def test_rule_of_thumb():
    assert rule_of_thumb_draft_length(0.9) == 4
    assert rule_of_thumb_draft_length(0.2) == 2  # never below 2, as in the article
    assert rule_of_thumb_draft_length(1.0) == 5
