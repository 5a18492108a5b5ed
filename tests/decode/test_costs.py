"""decode.costs and decode.timing: c as an estimate with an interval, and timing noise that shows instead of
passing for a difference; on tiny random models."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import decode.costs
from decode.acceptance import BlockTotals, drafter_costs, paired_speedup_ratio
from decode.costs import cost_signature, measure_cost_ratios, weight_bytes_per_token
from decode.timing import CpuWatch, median_ci, relative_spread, timing_check
from tests.decode.test_speculative import PROMPTS, drafter, target  # noqa: F401 (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

SLOW_S = 0.05  # a disturbed forward: many times a tiny model's own (1-10 ms), as a busy machine made the real pair's


def _slowed(model, when):
    """``model`` whose forwards sleep ``SLOW_S`` first while ``when()`` is true (an instance attribute: the
    module's class, and so its cost signature, stay as they were)."""
    plain = model.forward

    def forward(*args, **kwargs):
        if when():
            time.sleep(SLOW_S)
        return plain(*args, **kwargs)

    model.forward = forward
    return model


@pytest.fixture
def now(monkeypatch) -> dict:
    """``now["round"]``: the cost round running (0-based), counted as ``decode.costs`` starts each one."""
    state = {"round": 0}
    one_round = decode.costs._one_round

    def counted(models, inputs, caches, per_round, repeats):
        state["round"] = len(per_round["\0target"])
        one_round(models, inputs, caches, per_round, repeats)

    monkeypatch.setattr(decode.costs, "_one_round", counted)
    return state


def test_injected_timing_noise_widens_the_ratio_to_include_1(target, drafter, now):
    """Two drafters of identical weights (one carries an unused buffer, so they are not pooled into one c) and
    the same blocks; a slowed forward falls on the first in even rounds and on the second in odd ones, as
    another process's spells fall on whichever model runs. Holding the median c fixed gives a tight interval
    that excludes 1 (a verdict made by noise); resampling the rounds with the prompts includes 1, and the
    timing check calls the rounds disturbed."""
    first = _slowed(copy.deepcopy(drafter), lambda: now["round"] % 2 == 0)
    second = _slowed(copy.deepcopy(drafter), lambda: now["round"] % 2 == 1)
    second.register_buffer("unused", torch.zeros(1))
    assert cost_signature(first) != cost_signature(second)
    costs = measure_cost_ratios(target, {"first": first, "second": second}, PROMPTS[:2], rounds=5, max_rounds=5,
                                repeats=1)
    assert costs["timing"]["disturbed"] and "rounds disagree" in " ".join(costs["timing"]["reasons"])
    c_first, c_second = costs["cost_ratio_rounds"]["first"], costs["cost_ratio_rounds"]["second"]
    assert all(c_first[r] > 2 * c_second[r] for r in (0, 2, 4)) and all(c_second[r] > 2 * c_first[r] for r in (1, 3))
    lo, hi = costs["cost_ratio_ci95"]["first"]
    assert lo < costs["cost_ratios"]["first"] / 2 and hi >= costs["cost_ratios"]["first"]

    same_blocks = [BlockTotals(tokens=n, blocks=n / 3, drafted=n / 1.2) for n in range(20, 60)]
    a, b = (drafter_costs(costs["cost_ratios"][n], None, 3, cost_ratio_rounds=costs["cost_ratio_rounds"][n])
            for n in ("first", "second"))
    ratio = paired_speedup_ratio(same_blocks, a, same_blocks, b)
    assert ratio["ci95_prompts_only"][1] < 1  # the old interval: first "slower", tightly
    assert ratio["ci95"][0] < 1 < ratio["ci95"][1]


def test_more_rounds_run_while_they_disagree(target, drafter, now):
    noisy = _slowed(copy.deepcopy(drafter), lambda: now["round"] % 2 == 0)
    costs = measure_cost_ratios(target, {"noisy": noisy}, PROMPTS[:1], rounds=3, max_rounds=9, repeats=1)
    assert costs["rounds"] == 9 and len(costs["cost_ratio_rounds"]["noisy"]) == 9
    assert len(costs["target_forward_ms_rounds"]) == 9
    with pytest.raises(ValueError, match="max_rounds"):
        measure_cost_ratios(target, {"d": drafter}, PROMPTS[:1], rounds=5, max_rounds=3)


def test_costs_from_shapes_count_the_bytes_a_token_reads(target, drafter):
    costs = measure_cost_ratios(target, {"d": drafter}, PROMPTS[:1], rounds=2, max_rounds=2, repeats=1)
    embedding = drafter.get_input_embeddings().weight
    head = drafter.get_output_embeddings().weight
    total = sum(t.numel() * t.element_size() for t in [*drafter.parameters(), *drafter.buffers()])
    row = embedding.shape[1] * embedding.element_size()
    expected = total - embedding.numel() * embedding.element_size() + row if head is not embedding else total
    assert weight_bytes_per_token(drafter) == expected
    assert costs["cost_ratio_from_shapes"]["d"] == pytest.approx(expected / weight_bytes_per_token(target))
    assert 0 < costs["cost_ratio_quiet_floor"]["d"] and set(costs["cost_ratio_ci95"]) == {"d"}


def test_timing_statistics():
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0 and relative_spread([2.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert median_ci([0.2] * 7) == [0.2, 0.2]
    lo, hi = median_ci([0.1, 0.1, 0.1, 0.9, 0.9])
    assert lo == 0.1 and hi == 0.9
    quiet = timing_check({"c": [0.20, 0.21, 0.20, 0.205]}, 0.02)
    assert not quiet["disturbed"] and quiet["reasons"] == []
    busy = timing_check({"c": [0.20, 0.21, 0.20, 0.205]}, 0.6)
    assert busy["disturbed"] and "60% of the CPUs" in busy["reasons"][0]
    with CpuWatch() as watch:
        sum(range(200_000))
    assert watch.others_share is None or 0.0 <= watch.others_share <= 1.0


def test_an_int8_drafter_reads_its_int8_weights(drafter):
    from decode.quantization import drafter_for_decoding

    linear = sum(m.weight.numel() for m in drafter.modules() if isinstance(m, torch.nn.Linear))
    int8 = drafter_for_decoding(copy.deepcopy(drafter), "int8-dynamic")
    # every linear weight read at one byte an element (packed weights are unpacked one at a time: each counts)
    assert weight_bytes_per_token(int8) >= linear
    assert weight_bytes_per_token(int8) < weight_bytes_per_token(drafter)


def test_verify_cost_timing_draws_a_bar_between_rounds_and_none_when_asked_not_to(target, capsys):
    """Evaluate times these before it picks K (about a minute on a CPU): the bar moves after each prefill and
    each round, so the user never watches a silent minute."""
    costs, measured, rounds = decode.costs.timed_verify_costs(target, PROMPTS[:2], 4, rounds=2, progress=True)
    err = capsys.readouterr().err
    assert "verification costs (1..4 tokens)" in err and "5/5" in err  # 2 prefills + a warm-up round + 2 rounds
    assert len(rounds) == 2 and len(measured) == len(costs) == 4 and costs[0] == 1.0
    decode.costs.timed_verify_costs(target, PROMPTS[:2], 4, rounds=2)
    assert "verification costs" not in capsys.readouterr().err
