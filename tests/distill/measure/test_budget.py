"""The budget curve's fitted line and what report.md says it predicts."""

from __future__ import annotations

from distill.measure.budget import _fit, budget_curve_lines


def _points(ratios: dict[int, float]) -> list[dict]:
    return [{"drafter": f"checkpoint-{t}", "training_tokens": t, "step": 1, "acceptance_rate": 0.6,
             "acceptance_ci95": None, "mean_accepted_tokens": 3.9, "tau_ci95": None, "draft_length": 5,
             "tau_minus_undistilled": None, "predicted_speedup_ratio_to_stock": {"ratio": r, "ci95": None}}
            for t, r in ratios.items()]


def _text(ratios: dict[int, float]) -> str:
    points = _points(ratios)
    return "\n".join(budget_curve_lines({"budget_curve": {"points": points, "fit": _fit(points, 50.0)}}))


def test_a_rising_line_predicts_budgets_in_tokens_and_hours():
    text = _text({10_000: 1.00, 100_000: 1.05})  # +0.05 a decade: 1.10 at 1e6 tokens
    assert "1.10x at about 1e+06 tokens (5.56 h at this run's training rate)" in text


def test_a_nearly_flat_line_predicts_no_budget():
    text = _text({10_000: 0.994, 20_000: 0.997, 30_000: 1.000, 40_000: 0.999, 49_000: 0.999})
    assert "rises too little to predict a budget" in text and "49,000 tokens" in text and "e+17" not in text


def test_a_falling_line_predicts_none():
    assert "does not rise" in _text({10_000: 0.98, 100_000: 0.95})
