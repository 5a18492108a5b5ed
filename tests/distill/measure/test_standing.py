"""Where a one-point run stands on the reference budget curve: the section's figures and its caveats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distill.measure.report import render_report_markdown
from distill.measure.standing import REFERENCE_CURVE, load_reference, standing, training_recipe

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "reference_curve.py"

_REFERENCE = {
    "recipe": {"method": "full", "loss": "fkl", "lr": 2e-6, "lr_schedule": "constant"},
    "data": "scored ShareGPT", "held_out": "256 prompts", "host": "AVX2", "source": "RESULTS.md",
    "points": [{"drafter": f"checkpoint-{t}", "training_tokens": t,
                "tau_minus_stock": {"mean": 0.01 * i, "ci95": [0.0, 0.02 * i]},
                "predicted_speedup_ratio_to_stock": {"ratio": 1 + 0.01 * i, "ci95": [1.0, 1 + 0.02 * i]}}
               for i, t in enumerate((10_000, 30_000, 100_000), start=1)],
    "fit": {"slope_per_decade": 0.02, "intercept": 0.92},
}


def _report(tokens: int = 9_000, lr: float = 2e-6) -> dict:
    return {"training": {"tokens": tokens, "recipe": {"method": "full", "lr": lr}},
            "against_stock": {"tau_difference": {"mean_accepted_tokens": 0.02, "ci95": [-0.05, 0.08]},
                              "predicted_speedup_ratio": {"ratio": 1.004, "ci95": [0.987, 1.019]}}}


def test_the_nearest_points_and_the_fit_at_ten_times_the_tokens():
    s = standing(_report(), _REFERENCE)
    assert [p["training_tokens"] for p in s["nearest_reference_points"]] == [10_000, 30_000]
    assert s["reference_fit_ratio"] == {"9000": pytest.approx(0.92 + 0.02 * 3.954, abs=1e-3),
                                        "90000": pytest.approx(0.92 + 0.02 * 4.954, abs=1e-3)}
    assert s["recipe_differs"] == []
    text = render_report_markdown({**_report(), "curve_standing": s})
    assert "## Where this run stands on the budget curve" in text
    assert "This drafter trained on 9,000 tokens" in text and "tau +0.020 [-0.050, +0.080]" in text
    assert "| checkpoint-30000 | 30,000 | +0.020 [+0.000, +0.040] | 1.020 [1.000, 1.040] |" in text
    assert "at 90,000 (ten times them; an extrapolation" in text and "context only" not in text


def test_another_recipe_is_named_and_nothing_without_tokens_or_reference():
    s = standing(_report(lr=2e-5), _REFERENCE)
    assert s["recipe_differs"] == ["lr"]
    assert "differs from the reference's in `lr`" in render_report_markdown({"curve_standing": s})
    assert standing(_report(tokens=0), _REFERENCE) is None and standing(_report(), None) is None
    assert "stands on the budget curve" not in render_report_markdown({})


def test_the_shipped_reference_is_a_curve_and_the_recipe_is_read_from_config(tmp_path):
    shipped = load_reference(REFERENCE_CURVE)
    assert shipped["points"] and all(p["training_tokens"] > 0 for p in shipped["points"])
    assert load_reference(tmp_path / "absent.json") is None
    (tmp_path / "config.yaml").write_text("distill:\n  method: full\n  lr: 2.0e-06\n  loss: fkl\n  seed: 1\n"
                                          "drafter:\n  draft_vocab_size: null\n")
    assert training_recipe(tmp_path) == {"method": "full", "lr": 2e-6, "loss": "fkl", "draft_vocab_size": None}
    assert training_recipe(tmp_path / "none") == {}
    json.dumps(standing(_report(), shipped))  # report.json takes it as it is


def test_the_reference_is_written_from_a_measured_curve_and_a_report_without_one_is_refused(tmp_path):
    import subprocess
    import sys

    from distill.measure.standing import reference_from_report

    point = {"drafter": "checkpoint-13", "training_tokens": 9_981, "tau_minus_undistilled": {"mean": -0.02, "ci95": [-0.06, 0.02]},
             "predicted_speedup_ratio_to_stock": {"ratio": 0.994, "ci95": [0.984, 1.004]}}
    report = {"budget_curve": {"points": [{**point, "training_tokens": 0}, point],
                               "fit": {"slope_per_decade": 0.008, "intercept": 0.96, "points": 1, "of": "line"}},
              "simulated": {"num_prompts": 256, "draft_length": 5}, "training": {"recipe": {"lr": 2e-6}},
              "hardware": {"cpu_count": 2, "cpu_capability": "AVX512", "bf16_fast": False, "gpu": None}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "reference.json"
    proc = subprocess.run([sys.executable, str(_SCRIPT), str(path), "--data", "d", "--source", "s",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    written = load_reference(out)
    assert written == reference_from_report(report, "d", "s")
    assert written["points"] == [{"drafter": "checkpoint-13", "training_tokens": 9_981,
                                  "tau_minus_stock": point["tau_minus_undistilled"],
                                  "predicted_speedup_ratio_to_stock": point["predicted_speedup_ratio_to_stock"]}]
    assert written["recipe"] == {"lr": 2e-6} and "no bf16 units" in written["host"] and "256 prompts" in written["held_out"]
    path.write_text(json.dumps({"simulated": {}}))
    proc = subprocess.run([sys.executable, str(_SCRIPT), str(path), "--data", "d", "--source", "s",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode != 0 and "evaluate.checkpoints=true" in proc.stderr and load_reference(out) == written
