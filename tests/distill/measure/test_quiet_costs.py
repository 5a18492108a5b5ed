"""distill.measure.quiet_costs: a quiet run's c kept per host and pair of shapes, the fallback of a disturbed run."""

from __future__ import annotations

import json

import pytest

from distill.measure.quiet_costs import fallback_costs, host_key, remember


def _costs(**cost_ratios) -> dict:
    return {"target_signature": "t" * 16, "signatures": {name: f"sig-{name}" for name in cost_ratios},
            "cost_ratios": cost_ratios, "cost_ratio_ci95": {n: [c * 0.9, c * 1.1] for n, c in cost_ratios.items()},
            "cost_ratio_from_shapes": {name: 0.5 for name in cost_ratios}}


def test_a_disturbed_run_falls_back_on_this_hosts_quiet_runs(tmp_path):
    path = tmp_path / "quiet_costs.json"
    nothing = fallback_costs(_costs(stock=0.9), path)
    assert nothing["stock"] == {"cost_ratio": 0.5, "source": "shapes, uncalibrated (no quiet run on this host yet)"}
    remember(_costs(stock=0.14, distilled=0.16), "runs/quiet", path)
    record = json.loads(path.read_text())
    assert record[host_key()]["t" * 16]["sig-stock"]["cost_ratio"] == 0.14
    later = fallback_costs(_costs(stock=0.9, cut=0.4), path)  # a busy run: the stock drafter again, a new shape
    assert later["stock"]["cost_ratio"] == 0.14 and later["stock"]["source"].startswith("a quiet run on this host")
    assert later["cut"]["cost_ratio"] == pytest.approx(0.5 * 0.15 / 0.5)  # shapes x the median quiet / shapes
    assert later["cut"]["source"] == "shapes, calibrated by 2 quiet measurement(s) on this host"
    other_target = {**_costs(stock=0.9), "target_signature": "u" * 16}
    assert "uncalibrated" in fallback_costs(other_target, path)["stock"]["source"]
    path.write_text("{damaged")
    assert "uncalibrated" in fallback_costs(_costs(stock=0.9), path)["stock"]["source"]
