"""report.md and the PNG plots rendered from a report.json-shaped dict."""

from __future__ import annotations

from distill.measure.report import render_report_markdown, write_report_plots


def _report() -> dict:
    figures = {"acceptance_rate": 0.7, "alpha": 0.85, "mean_accepted_tokens": 3.1, "speedup": 2.2,
               "speculative_tokens_per_s": 14.0, "target_tokens_per_s": 6.3, "draft_length": 3,
               "per_position_acceptance": [0.8, 0.9, 0.95], "theoretical_speedup": 2.3,
               "measured_over_theoretical": 0.96, "outputs_match_target": True,
               "draft_length_choice": {"best_draft_length": 4, "rule_of_thumb": 3, "cost_ratio": 0.12,
                                       "speculation_pays": True,
                                       "expected_speedup_by_k": {1: 1.6, 2: 2.0, 3: 2.3, 4: 2.4}}}
    return {**figures, "num_prompts": 6, "new_tokens": 600,
            "target": {"name": "t"}, "drafter": {"base_name": "d", "init": "sibling"},
            "baselines": {"target": {"engine": "transformers generate"},
                          "hf_assisted": {"tokens_per_s": 13.0, "speedup": 2.05, "outputs_match_target": True}},
            "baseline_drafter": {**figures, "acceptance_rate": 0.72, "speedup": 2.3},
            "per_category": {"code": {**figures, "num_prompts": 3}},
            "distill_validation": {"val_expected_acceptance_before": 0.97, "val_expected_acceptance_after": 0.98},
            "decode": {"drafter_quantization_used": "int8-dynamic"}}


def test_markdown_has_every_section():
    text = render_report_markdown(_report())
    for heading in ("## Expected vs measured acceptance", "## Transformers assisted generation",
                    "## Choice of draft length K", "## Per prompt category", "## Acceptance by draft position"):
        assert heading in text, heading
    assert "| measured / theoretical speedup | 0.96 | 0.96 |" in text
    assert "Recommended K = 4" in text and "K = max(2, int(accuracy x 5)) gives K = 3" in text
    assert "| expected acceptance 1 - TV" in text and "| 0.970 | 0.980 |" in text
    assert "drafter run as int8-dynamic" in text


def test_validation_tau_on_scored_answers_is_labelled_a_proxy():
    report = _report()
    report["distill_validation"].update(val_simulated_tau_before=2.9, val_simulated_tau_after=3.0,
                                        val_simulated_draft_length=3)
    assert "a proxy" not in render_report_markdown(report)  # the target's own greedy answers: exact
    report["data"] = {"answers": "dataset"}
    text = render_report_markdown(report)
    assert "simulated on the validation split (on the dataset's answers, which the target scored but did not " \
           "write: a proxy) | 2.90 | 3.00 |" in text
    assert "the held-out row is exact" in text and "are one quantity" not in text


def test_plots_are_written(tmp_path):
    names = [p.name for p in write_report_plots(_report(), tmp_path)]
    assert names == ["acceptance_by_position.png", "tokens_per_s.png", "speedup_vs_k.png",
                     "expected_vs_measured_acceptance.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_compared_drafters_get_a_column_and_a_bar(tmp_path):
    report = _report()
    report["compared_drafters"] = {"qwen2.5-coder-0.5b-instruct": {"acceptance_rate": 0.66, "speedup": 1.9,
                                                                   "speculative_tokens_per_s": 12.0}}
    text = render_report_markdown(report)
    assert "| figure | undistilled drafter | distilled drafter | `qwen2.5-coder-0.5b-instruct` |" in text
    assert "| acceptance rate (accepted / drafted tokens) | 0.720 | 0.700 | 0.660 |" in text
    assert "| speedup vs target alone | 2.30x | 2.20x | 1.90x |" in text
    assert "tokens_per_s.png" in [p.name for p in write_report_plots(report, tmp_path)]
    report["compared_drafters"] = {"/home/me/runs/distill/drafter": {"acceptance_rate": 0.5}}
    report["drafter"] = {"base_name": "d", "init": "layers", "num_layers": 3, "layers": [0, 1, 23]}
    text = render_report_markdown(report)
    assert "| `distill/drafter` |" in text and "`/home/me/runs/distill/drafter`" in text
    assert "(3 layers [0-1, 23])" in text


def test_training_plot_draws_the_validation_curve(tmp_path):
    import json

    metrics = tmp_path / "checkpoints" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("".join(json.dumps({"step": s, "loss": 2.0 / s, "expected_acceptance": 0.1 * s}) + "\n"
                               for s in range(1, 7)))
    (metrics.parent / "validation.jsonl").write_text("".join(
        json.dumps({"step": s, "val_loss": 2.5 - 0.2 * s, "val_expected_acceptance": 0.3 + 0.05 * s,
                    "val_top1_agreement": 0.4 + 0.05 * s}) + "\n" for s in (0, 3, 6)))
    written = write_report_plots(_report(), tmp_path / "plots", training_metrics=metrics) \
        if (tmp_path / "plots").mkdir() is None else []
    assert (tmp_path / "plots" / "training.png") in written
    assert (tmp_path / "plots" / "training.png").stat().st_size > 1000


def test_the_generate_runs_trained_on_are_named():
    report = _report()
    assert "Distilled on" not in render_report_markdown(report)  # older reports: no sentence
    report["distill_inputs"] = {"generate": "/o/generate/run-a"}
    report["drafter"]["training_data"] = {"train_examples": 1200, "val_examples": 40, "generate_runs": 1}
    assert "Distilled on 1,200 examples from `generate/run-a`." in render_report_markdown(report)
    report["distill_inputs"]["extra_generate"] = ["/o/generate/run-b"]
    text = render_report_markdown(report)
    assert "Distilled on 1,200 examples from `generate/run-a`, `generate/run-b` (`inputs.extra_generate`" in text


def test_drafters_that_were_only_simulated_get_no_timed_column(tmp_path):
    """evaluate.timed_drafters=distilled: the undistilled drafter has simulated figures alone; report.md drops
    its timed column, says why, and takes per-position acceptance from the simulation for both drafters."""
    report = _report()
    simulated = {"num_prompts": 64, "num_tokens": 4000, "draft_length": 3, "acceptance_rate": 0.7,
                 "mean_accepted_tokens": 3.0, "per_position_acceptance": [0.81, 0.82, 0.83],
                 "ci95": {"acceptance_rate": [0.6, 0.8], "mean_accepted_tokens": [2.8, 3.2]}}
    report["simulated"] = simulated
    report["baseline_drafter"] = {"timed": False, "simulated": {**simulated, "per_position_acceptance": [0.5, 0.6, 0.7]},
                                  "against_stock": {"tau_difference": {"mean_accepted_tokens": -0.1, "ci95": [-0.2, 0.0]},
                                                    "timed_speedup_ratio": None}}
    report["drafter_stock"] = "undistilled"
    report["against_stock"] = {"tau_difference": {"mean_accepted_tokens": 0.1, "ci95": [0.0, 0.2]},
                               "timed_speedup_ratio": None}
    text = render_report_markdown(report)
    assert "| figure | distilled drafter |" in text and "| speedup vs target alone | 2.20x |" in text
    assert "Not timed here (`evaluate.timed_drafters=distilled`): the undistilled drafter;" in text
    assert "## Acceptance by draft position (P(accepted | reached); simulated on all 64 prompts)" in text
    assert "| 1 | 0.500 | 0.810 |" in text
    assert "timed speedup ratio" not in text and "| distilled drafter | +0.100 [+0.000, +0.200] | - | - | - |" in text
    assert "acceptance_by_position.png" in [p.name for p in write_report_plots(report, tmp_path)]


def test_costs_text_names_drafters_that_share_one_c():
    report = _report()
    report["simulated"] = {"num_prompts": 8, "num_tokens": 100, "draft_length": 3, "acceptance_rate": 0.7,
                           "mean_accepted_tokens": 3.0}
    report["side_by_side_costs"] = {"cost_ratios": {"distilled": 0.2, "undistilled": 0.2, "stock": 0.25},
                                    "cost_ratio_range": {"distilled": [0.19, 0.22], "undistilled": [0.18, 0.21],
                                                         "stock": [0.24, 0.26]},
                                    "pooled": [["distilled", "undistilled"]], "rounds": 5, "prompts": 3,
                                    "target_forward_ms": 180.0}
    text = render_report_markdown(report)
    assert "distilled 0.200 [0.190, 0.220], undistilled 0.200 [0.180, 0.210], stock 0.250 [0.240, 0.260]" in text
    assert "c and its range over rounds" in text  # an older report: no interval, its range
    assert "distilled and undistilled have the same modules and shapes, so they share one c" in text


def test_sampled_reports_do_not_call_their_tau_greedy():
    report = _report()
    report["simulated"] = {"num_prompts": 8, "num_tokens": 100, "draft_length": 3, "acceptance_rate": 0.6,
                           "mean_accepted_tokens": 2.5, "kind": "expected (speculative sampling, along target-sampled "
                                                                "answers)"}
    report["baseline_drafter"]["simulated"] = {**report["simulated"], "mean_accepted_tokens": 2.4}
    report["distill_validation"]["val_simulated_tau_after"] = 2.9
    text = render_report_markdown(report)
    assert "| tau, simulated on every held-out prompt (this report, expected (speculative sampling" in text
    assert "two different quantities" in text and "greedy tau, simulated on every held-out prompt" not in text


def test_the_headline_reads_under_sampling_and_greedy():
    from distill.measure.report import _stock_reach

    sampled = {"mean_accepted_tokens": 3.13, "draft_length": 3}
    assert _stock_reach(sampled) == "already reaches an expected tau 3.13 at K = 3 under sampling"
    greedy = {**sampled, "top1_agreement": 0.862}
    assert _stock_reach(greedy) == ("already picks the target's greedy token at 86.2% of answer positions "
                                    "(tau 3.13 at K = 3)")


def test_the_training_sentence_says_who_wrote_the_answers():
    report = _report()
    report["distill_inputs"] = {"generate": "/o/generate/run-a"}
    report["drafter"]["training_data"] = {"train_examples": 12}
    report["data"] = {"answers": "dataset", "training_answer_tokens": 5669}
    assert ("Distilled on 12 examples from `generate/run-a` (5,669 answer tokens, from the dataset, scored by the "
            "target).") in render_report_markdown(report)
    report["data"]["answers"] = "target"
    assert "(5,669 answer tokens, written by the target)." in render_report_markdown(report)


def _against_stock_report(ratio, ci95, timing=None) -> dict:
    report = _report()
    sim = {"num_prompts": 64, "num_tokens": 4000, "draft_length": 3, "acceptance_rate": 0.7,
           "mean_accepted_tokens": 3.0, "recommended_draft_length": 4,
           "per_k": {"4": {"predicted_speedup": 2.0}}, "ci95": {"predicted_speedup_at_best_k": [1.9, 2.1]}}
    report["simulated"] = sim
    report["baseline_drafter"]["simulated"] = {**sim, "top1_agreement": 0.8}
    report["drafter_stock"] = "undistilled"
    report["against_stock"] = {"predicted_speedup_ratio": {"ratio": ratio, "ci95": ci95},
                               "predicted_speedup_ratio_fallback": {
                                   "ratio": 0.99, "ci95": [0.97, 1.01],
                                   "sources": ["a quiet run on this host (2026-12-05 08:00)",
                                               "a quiet run on this host (2026-12-05 08:00)"]}}
    report["side_by_side_costs"] = {
        "cost_ratios": {"distilled": 0.215, "undistilled": 0.051}, "rounds": 20, "prompts": 3,
        "cost_ratio_range": {"distilled": [0.031, 1.114], "undistilled": [0.029, 0.542]},
        "cost_ratio_ci95": {"distilled": [0.05, 0.9], "undistilled": [0.03, 0.3]},
        "cost_ratio_rounds": {"distilled": [0.2] * 20, "undistilled": [0.05] * 20}, "target_forward_ms": 739.0,
        "cost_ratio_from_shapes": {"distilled": 0.3, "undistilled": 0.31},
        "cost_ratio_fallback": {"distilled": {"cost_ratio": 0.134,
                                              "source": "a quiet run on this host (2026-12-05 08:00)"},
                                "undistilled": {"cost_ratio": 0.137, "source": "shapes, calibrated by 2 quiet "
                                                                               "measurement(s) on this host"}},
        "cost_ratio_quiet_floor": {"distilled": 0.031, "undistilled": 0.029}}
    if timing is not None:
        report["timing"] = timing
    return report


def test_no_speed_verdict_from_disturbed_timing():
    """The issue's busy run: c 0.215 against 0.051 from rounds spread over [0.03, 1.1]. The report says at the
    top that the timing was disturbed and states neither "slower" nor "faster"; the estimate from shapes
    stands beside it. On quiet timing the same interval gives its verdict."""
    disturbed = {"disturbed": True, "reasons": ["other processes used 48% of the CPUs while the costs were timed"]}
    text = render_report_markdown(_against_stock_report(0.585, [0.548, 0.622], disturbed))
    top = text.split("## In short")[0]
    assert "**The timing was disturbed**: other processes used 48% of the CPUs" in top
    short = text.split("## In short")[1].split("##")[0]
    assert "0.585x its speed [0.548, 0.622], not judged: the timing was disturbed" in short
    assert "slower" not in short and "faster" not in short
    assert ("With the fallback c instead (the distilled drafter's from a quiet run on this host (2026-12-05 08:00), "
            "the stock one's from a quiet run on this host (2026-12-05 08:00)): 0.990x [0.970, 1.010]") in short
    assert "distilled 0.215 [0.050, 0.900]" in text
    assert "c distilled 0.134 (from a quiet run on this host (2026-12-05 08:00)), undistilled 0.137 (from shapes, " \
           "calibrated by 2 quiet measurement(s) on this host)" in text
    assert "the intervals resample the prompts and the timing rounds together" in text
    quiet = render_report_markdown(_against_stock_report(0.585, [0.548, 0.622], {"disturbed": False, "reasons": []}))
    assert "The timing was disturbed" not in quiet and "slower, the interval excludes no loss" in quiet
    assert "fallback" not in quiet
    even = render_report_markdown(_against_stock_report(0.99, [0.95, 1.03], {"disturbed": False, "reasons": []}))
    assert "0.990x its speed [0.950, 1.030], no difference shown at this size" in even


def test_the_model_card_and_older_reports_follow_the_same_rule():
    from distill.measure.timing_trust import disturbed, speed_verdict_word
    from distill.stages.export import _speed_caveats

    busy = _against_stock_report(0.585, [0.548, 0.622], {"disturbed": True, "reasons": ["the rounds disagree"]})
    assert any("**The timing was disturbed**: the rounds disagree" in line for line in _speed_caveats(busy))
    older = _against_stock_report(0.585, [0.548, 0.622])  # no "timing": the busy share before measuring decides
    older["cpu_busy_before"] = 0.4
    assert disturbed(older) and speed_verdict_word(older["against_stock"]["predicted_speedup_ratio"], older) == \
        "not judged"
    older["cpu_busy_before"] = 0.05
    assert speed_verdict_word(older["against_stock"]["predicted_speedup_ratio"], older) == "slower"
