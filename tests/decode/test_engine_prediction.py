"""decode.engines.prediction: an engine's predicted speedup from exact tau and its measured costs."""

from __future__ import annotations

import pytest

from decode.engines.prediction import engine_cost_ratios, predict_engine_speedups

COSTS = {"target_step_s": 0.2, "drafter_step_s": 0.05, "one_token_forward_s": 0.2,
         "verify_s": {"1": 0.2, "2": 0.22, "3": 0.24, "4": 0.3}}


def test_costs_become_c_and_verification_in_one_token_forwards():
    c, verify = engine_cost_ratios(COSTS)
    assert c == pytest.approx(0.25)
    assert verify == pytest.approx({1: 1.1, 2: 1.2, 3: 1.5})  # K drafts are verified in K + 1 tokens


def test_prediction_is_tau_over_drafting_plus_verification():
    per_k = {"1": {"mean_accepted_tokens": 1.8}, "2": {"mean_accepted_tokens": 2.4, "mean_draft_length": 1.9},
             "5": {"mean_accepted_tokens": 3.9}}
    predicted = predict_engine_speedups(per_k, COSTS)
    assert set(predicted) == {1, 2}  # K = 3 has no simulated tau, K = 5 no measured verification
    assert predicted[1] == pytest.approx(1.8 / (1 * 0.25 + 1.1))
    assert predicted[2] == pytest.approx(2.4 / (1.9 * 0.25 + 1.2))  # blocks cut by max_new_tokens draft fewer
