"""Markdown rendering of ``report.json``: the figures people compare, readable without JSON."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from distill.files import write_bytes_atomic, write_text_atomic
from distill.measure.budget import budget_curve_lines, plot_budget_curve
from distill.measure.standing import standing_lines
from distill.measure.engines import engines_table
from distill.measure.timing_trust import disturbed, disturbed_sentence, speed_verdict

_ROWS = [  # (label, key, format)
    ("acceptance rate (accepted / drafted tokens)", "acceptance_rate", "{:.3f}"),
    ("alpha (per-token acceptance, Leviathan et al. 2023)", "alpha", "{:.3f}"),
    ("mean accepted tokens per target forward tau (incl. bonus)", "mean_accepted_tokens", "{:.2f}"),
    ("speculative tokens/s", "speculative_tokens_per_s", "{:.2f}"),
    ("target alone tokens/s", "target_tokens_per_s", "{:.2f}"),
    ("speedup vs target alone", "speedup", "{:.2f}x"),
    ("cost ratio c (drafter / target forward)", "cost_ratio", "{:.3f}"),
    ("theoretical speedup (alpha, K, c; Leviathan et al. Thm 3.8)", "theoretical_speedup", "{:.2f}x"),
    ("measured / theoretical speedup", "measured_over_theoretical", "{:.2f}"),
    ("cost-model speedup (tau, c, measured (K+1)-token verify cost)", "cost_model_speedup", "{:.2f}x"),
    ("verify cost: (K+1)-token target forward / 1-token forward", "verify_cost", "{:.2f}"),
    ("one block's time / its forwards timed alone (1 = no loop overhead)", "measured_over_cost_model", "{:.2f}"),
    ("mean draft length per block", "mean_draft_length", "{:.2f}"),
    ("greedy output identical to target", "outputs_match_target", "{}"),
    ("share of target tokens reproduced before any divergence", "identical_token_fraction", "{:.3f}"),
]


def short_name(name: str) -> str:
    """A model name as a column or bar label: a folder path shortened to its last two parts."""
    parts = [p for p in str(name).replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) if len(parts) > 1 else str(name)


def _drafter_shape(drafter: dict[str, Any]) -> str:
    if drafter.get("init") == "layers" and drafter.get("num_layers"):
        from distill.drafters.build import describe_layers

        return describe_layers(drafter["num_layers"], drafter.get("layer_selection") or "first", drafter.get("layers"))
    return str(drafter.get("init"))


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _training_data(report: dict[str, Any]) -> list[str]:
    """A sentence naming the generate runs the drafter was distilled on (absent in older reports)."""
    inputs = report.get("distill_inputs") or {}
    runs = [inputs["generate"]] + list(inputs.get("extra_generate") or []) if inputs.get("generate") else []
    if not runs:
        return []
    data = (report.get("drafter") or {}).get("training_data") or {}
    count = f"{data['train_examples']:,} examples from " if data.get("train_examples") is not None else ""
    given = report.get("data") or {}
    tokens = given.get("training_answer_tokens")
    source = {"target": "written by the target", "dataset": "from the dataset, scored by the target"}.get(
        given.get("answers"), "")
    about = f" ({tokens:,} answer tokens{', ' + source if source else ''})" if tokens else ""
    return [f"Distilled on {count}" + ", ".join(f"`{short_name(r)}`" for r in runs) + about
            + (" (`inputs.extra_generate` added the later runs)" if len(runs) > 1 else "") + ".", ""]


def _eval_set(report: dict[str, Any]) -> str:
    """'held-out prompts', or the prompt file of ``evaluate.prompts`` and how many of its prompts were trained on."""
    eval_set = report.get("eval_prompts") or {}
    seen = eval_set.get("seen_in_training")
    overlap = ("overlap with the training data unknown (a training run folder is gone)" if seen is None else
               "none of them in the training data" if seen == 0 else
               f"**{seen} of them in the training data**, which flatters the distilled drafter")
    if eval_set.get("source", "held-out") == "held-out":
        if "generate" not in eval_set:  # the drafter's own generate run: its held-out prompts were never trained on
            return "held-out prompts"
        return f"held-out prompts of `{eval_set['generate']}` (`inputs.generate`; {overlap})"
    return f"prompts of `{eval_set['source']}` (`evaluate.prompts`; {overlap})"


def _ci(figures: dict[str, Any], key: str, fmt: str) -> str:
    """``value [lo, hi]`` from a ``simulated`` entry and its ``ci95``."""
    interval = (figures.get("ci95") or {}).get(key)
    text = _fmt(figures.get(key), fmt)
    return f"{text} [{_fmt(interval[0], fmt)}, {_fmt(interval[1], fmt)}]" if interval else text


def simulated_drafters(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Label -> ``simulated`` entry of every drafter in the report, in a fixed order."""
    rows = {}
    for label, entry in (("undistilled drafter", report.get("baseline_drafter") or {}), ("distilled drafter", report),
                         *(((f"`{short_name(n)}`", o) for n, o in (report.get("compared_drafters") or {}).items())),
                         ("prompt lookup (no model)", ((report.get("baselines") or {}).get("prompt_lookup") or {}))):
        if entry.get("simulated"):
            rows[label] = entry["simulated"]
    return rows


def _best_k_speedup(sim: dict[str, Any]) -> str:
    """The predicted speedup at the recommended K with its interval (prompts and timing rounds resampled), e.g.
    ``2.41x [2.33, 2.50]``."""
    speedup = ((sim.get("per_k") or {}).get(str(sim.get("recommended_draft_length"))) or {}).get("predicted_speedup")
    interval = (sim.get("ci95") or {}).get("predicted_speedup_at_best_k")
    text = _fmt(speedup, "{:.2f}x")
    return f"{text} [{interval[0]:.2f}, {interval[1]:.2f}]" if interval and speedup is not None else text


def _costs_text(report: dict[str, Any]) -> str:
    """How the c of the predicted speedups was measured, with its interval (or, in older reports, its range)
    over the rounds, and the estimates from shapes and from the quickest rounds beside it when the timing was
    disturbed."""
    costs = report.get("side_by_side_costs")
    if not costs:
        return "measured in this run's timed decoding"
    bounds = costs.get("cost_ratio_ci95") or costs["cost_ratio_range"]
    spread = ", ".join(f"{_drafter_label(n)} {c:.3f} [{bounds[n][0]:.3f}, {bounds[n][1]:.3f}]"
                       for n, c in costs["cost_ratios"].items())
    what = "c and its 95% interval over the rounds" if "cost_ratio_ci95" in costs else "c and its range over rounds"
    pooled = "".join(f"; {' and '.join(_drafter_label(n) for n in group)} have the same modules and shapes, so "
                     "they share one c from their pooled rounds" for group in costs.get("pooled") or [])
    text = (f"timed side by side ({costs['rounds']} interleaved rounds on {costs['prompts']} prompts, the target's "
            f"one-token forward {costs['target_forward_ms']:.0f} ms; {what}: {spread}{pooled})")
    if disturbed(report) and costs.get("cost_ratio_fallback"):
        fallback = ", ".join(f"{_drafter_label(n)} {f['cost_ratio']:.3f} (from {f['source']})"
                             for n, f in costs["cost_ratio_fallback"].items())
        floor = ", ".join(f"{_drafter_label(n)} {c:.3f}"
                          for n, c in (costs.get("cost_ratio_quiet_floor") or {}).items())
        text += (f". The timing was disturbed, so beside it, labelled: c {fallback} (shapes: the weight bytes one "
                 f"token's forward reads, drafter / target)" + (f"; c from each model's quickest round: {floor}"
                                                                 if floor else ""))
    return text


def _intervals_cover(report: dict[str, Any]) -> str:
    """What the predicted speedups' intervals resample: prompts and timing rounds, or (older reports) prompts."""
    if (report.get("side_by_side_costs") or {}).get("cost_ratio_rounds"):
        return ("tau is exact, the costs are timings: the intervals resample the prompts and the timing rounds "
                "together, so they cover both")
    return "the costs carry timing noise, tau does not; the intervals hold them fixed"


def _drafter_label(name: str) -> str:
    return name if name in ("distilled", "undistilled") else short_name(name)


def _verify_text(report: dict[str, Any]) -> str:
    """The verification costs behind the predicted speedups: the smoothed curve and how far the raw one was."""
    smooth, raw = report.get("verify_costs"), report.get("verify_costs_measured")
    if not smooth:
        return ""
    shown = ", ".join(f"{n + 1}: {v:.2f}" for n, v in enumerate(smooth[:9]))
    text = f" (in one-token forwards by tokens verified, {shown}"
    if raw:
        rounds = len(report.get("verify_cost_rounds") or []) or 3  # older reports: 3 rounds, not kept
        text += (f"; medians of {rounds} interleaved rounds on the first timed prompts, made non-decreasing, at most "
                 f"{max(abs(a - b) for a, b in zip(smooth, raw)):.2f} from the raw medians")
    return text + ")"


def _simulated_lines(report: dict[str, Any]) -> list[str]:
    """The exact (simulated) acceptance table over every held-out prompt, the paired difference and the check."""
    rows = simulated_drafters(report)
    if not rows:
        return []
    first = next(iter(rows.values()))
    lines = ["## Acceptance on every held-out prompt (simulated exactly from teacher-forced passes)", "",
             f"{first.get('num_prompts')} prompts, {first.get('num_tokens')} target tokens, {first.get('kind')}, "
             f"K = {first.get('draft_length')} ({first.get('schedule')}); 95% intervals are bootstraps over prompts. Predicted speedup = "
             f"tau / (K c + verify cost), with one verification cost of the target{_verify_text(report)} and each "
             f"drafter's c {_costs_text(report)} ({_intervals_cover(report)}).", "",
             "| drafter | acceptance | tau | predicted speedup at K | best K | predicted speedup at best K | "
             "heuristic schedule tau |", "|---|---|---|---|---|---|---|"]
    for label, sim in rows.items():
        best, k = sim.get("recommended_draft_length"), str(sim.get("draft_length"))  # a timed drafter's own K under auto
        per_k = sim.get("per_k") or {}
        lines.append(f"| {label} | {_ci(sim, 'acceptance_rate', '{:.3f}')} | {_ci(sim, 'mean_accepted_tokens', '{:.2f}')} | "
                     f"{_fmt((per_k.get(k) or {}).get('predicted_speedup'), '{:.2f}x')} | {_fmt(best, '{}')} | "
                     f"{_best_k_speedup(sim)} | "
                     f"{_fmt((sim.get('heuristic') or {}).get('mean_accepted_tokens'), '{:.2f}')} |")
    paired = report.get("paired_difference")
    if paired:
        lo, hi = paired["ci95"]
        verdict = ("the interval excludes 0: distillation changed tau" if lo > 0 or hi < 0 else
                   "the interval includes 0: no difference shown at this size")
        lines += ["", f"Paired difference, distilled minus undistilled tau on the same prompts: "
                  f"{paired['mean_accepted_tokens']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({verdict})."]
    lines += _against_stock_lines(report)
    check = report.get("simulation_check")
    if check:
        totals = (f"; accepted drafts {check['accepted_tokens'][0]} simulated vs {check['accepted_tokens'][1]} decoded "
                  f"in {check['num_blocks'][0]} vs {check['num_blocks'][1]} blocks" if check.get("accepted_tokens") else "")
        lines += ["", f"Simulation check on the {check['prompts']} timed prompts (simulated on the decoder's own output): "
                  f"{check['identical_blocks']} of {check['blocks']} blocks identical before any difference, "
                  f"{check.get('identical_prompts', '-')} prompts identical throughout{totals}. Exact in float32; an "
                  "int8 drafter's full forward rounds differently from its one-token forwards (and a bf16 target's "
                  "verification from its one-token decoding), so near-ties can flip a block there."]
    per_cat = first if "distilled drafter" not in rows else rows["distilled drafter"]
    categories = per_cat.get("per_category") or {}
    if len(categories) > 1:
        lines += ["", "| category (distilled drafter) | prompts | acceptance | tau |", "|---|---|---|---|"]
        lines += [f"| {c} | {f.get('num_prompts')} | {_ci(f, 'acceptance_rate', '{:.3f}')} | "
                  f"{_ci(f, 'mean_accepted_tokens', '{:.2f}')} |" for c, f in sorted(categories.items())]
    return lines + [""]


def _against_stock_lines(report: dict[str, Any]) -> list[str]:
    """Every drafter against the stock one (the base model as shipped) on the same prompts, paired."""
    stock = report.get("drafter_stock")
    sections = [("undistilled drafter", report.get("baseline_drafter") or {}), ("distilled drafter", report),
                *((f"`{short_name(n)}`", o) for n, o in (report.get("compared_drafters") or {}).items())]
    rows = [(label, section["against_stock"]) for label, section in sections if section.get("against_stock")]
    if not stock or not rows:
        return []
    name = "the undistilled drafter" if stock == "undistilled" else f"`{short_name(stock)}`"
    timed = any(against.get("timed_speedup_ratio") is not None for _, against in rows)
    lines = ["", f"Against the stock drafter ({name}: the base model as shipped, whole, full vocabulary), paired on "
             "the same prompts. The speedup ratio takes each drafter at its own best K with its measured c ("
             + _intervals_cover(report) + ")"
             + ("; the timed ratio is the decoder's on the timed prompts only." if timed else "."), "",
             "| drafter | tau minus stock's, at the run's K | predicted speedup ratio at best K | best K (it / stock) | "
             "c (it / stock) |" + (" timed speedup ratio |" if timed else ""), "|---|---|---|---|---|" + ("---|" if timed else "")]
    for label, against in rows:
        tau, ratio = against.get("tau_difference") or {}, against.get("predicted_speedup_ratio") or {}
        tau_text = (f"{tau['mean_accepted_tokens']:+.3f} [{tau['ci95'][0]:+.3f}, {tau['ci95'][1]:+.3f}]"
                    if tau else "-")
        ratio_text = f"{ratio['ratio']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]" if ratio else "-"
        ks = " / ".join(str(k) for k in ratio.get("draft_lengths") or []) or "-"
        cs = " / ".join(f"{c:.3f}" for c in ratio.get("cost_ratios") or []) or "-"
        lines.append(f"| {label} | {tau_text} | {ratio_text} | {ks} | {cs} |"
                     + (f" {_fmt(against.get('timed_speedup_ratio'), '{:.3f}')} |" if timed else ""))
    return lines


def render_report_markdown(report: dict[str, Any]) -> str:
    """A Markdown page: the before/after table, HF assisted baseline, per-category and per-position figures."""
    sections = (_header, _timed_table, _validation_section, budget_curve_lines, standing_lines, _hf_assisted_section,
                _engines_section, _draft_length_section, _per_category_section, _per_position_section, _stages_section, _plots_and_notes)
    return "\n".join(line for section in sections for line in section(report)) + "\n"


def _header(report: dict[str, Any]) -> list[str]:
    """The title, the run's one-line description, the training data and the simulated sections."""
    lines = [
        "# draftsmith evaluation report", "",
        f"Target `{report.get('target', {}).get('name')}`, drafter from `{report.get('drafter', {}).get('base_name')}` "
        f"({_drafter_shape(report.get('drafter') or {})}), draft length K = {report.get('draft_length')}, "
        f"{report.get('num_prompts')} {_eval_set(report)}, {report.get('new_tokens')} new tokens. "
        f"Engine: {report.get('engine')}; drafter run as "
        f"{(report.get('decode') or {}).get('drafter_quantization_used', 'stored')}.", "",
    ]
    warning = disturbed_sentence(report)
    lines += [warning, ""] if warning else []
    lines += _headline(report)
    lines += _training_data(report)
    lines += _simulated_lines(report)
    return lines


def _host_kind(report: dict[str, Any]) -> str:
    hw = report.get("hardware") or {}
    if hw.get("gpu"):
        return f"on {hw['gpu']}"
    if "bf16_fast" not in hw:
        return "on a host of unrecorded kind"
    units = "with bf16 units" if hw["bf16_fast"] else "without bf16 units (float32)"
    return f"on a {hw.get('cpu_count')}-core CPU {units}"


def _headline(report: dict[str, Any]) -> list[str]:
    """What a user reads first: the distilled drafter's predicted speedup, its ratio to the stock drafter's
    (paired interval), and, when no drafter here gains 10% over the stock one, the headroom the pair left."""
    sim = report.get("simulated") or {}
    if not sim.get("recommended_draft_length"):
        return []
    against = (report.get("against_stock") or {}).get("predicted_speedup_ratio")
    lines = ["## In short", "", f"On {sim.get('num_prompts')} held-out prompts {_host_kind(report)}, simulated "
             f"exactly with the measured costs: the distilled drafter's predicted speedup over the target alone is "
             f"{_best_k_speedup(sim)} at its best K = {sim['recommended_draft_length']} (timed on "
             f"{report.get('num_prompts')} prompts at K = {report.get('draft_length')}: "
             f"{_fmt(report.get('speedup'), '{:.2f}x')})."]
    stock = _stock_section(report)
    if against and stock:
        lo, hi = against["ci95"]
        lines[-1] += (f" Against the stock drafter ({_best_k_speedup(stock['simulated'])} at K = "
                      f"{stock['simulated'].get('recommended_draft_length')}): {against['ratio']:.3f}x its speed "
                      f"[{lo:.3f}, {hi:.3f}], {speed_verdict(against, report)}.")
        fallback = (report.get("against_stock") or {}).get("predicted_speedup_ratio_fallback")
        if disturbed(report) and fallback:
            lines[-1] += (f" With the fallback c instead (the distilled drafter's from {fallback['sources'][0]}, "
                          f"the stock one's from {fallback['sources'][1]}): {fallback['ratio']:.3f}x "
                          f"[{fallback['ci95'][0]:.3f}, {fallback['ci95'][1]:.3f}] over prompts.")
        best_label, best = _best_against_stock(report)
        if best is not None and best < 1.10:
            lines[-1] += (f" The pair leaves little headroom: the stock drafter {_stock_reach(stock['simulated'])}, "
                          f"and the best drafter measured here, {best_label}, is {best:.3f}x the stock drafter's "
                          f"predicted speed (the goal is 1.10x).")
    return lines + [""]


def _stock_reach(sim: dict[str, Any]) -> str:
    """How close the stock drafter already is: its greedy agreement and tau, or (sampled) its expected tau."""
    tau = f"tau {_fmt(sim.get('mean_accepted_tokens'), '{:.2f}')} at K = {sim.get('draft_length')}"
    agree = sim.get("top1_agreement")  # greedy only
    if agree is not None:
        return f"already picks the target's greedy token at {agree:.1%} of answer positions ({tau})"
    return f"already reaches an expected {tau} under sampling"


def _stock_section(report: dict[str, Any]) -> dict[str, Any] | None:
    stock = report.get("drafter_stock")
    if stock == "undistilled":
        return report.get("baseline_drafter")
    return (report.get("compared_drafters") or {}).get(stock) if stock else None


def _best_against_stock(report: dict[str, Any]) -> tuple[str, float | None]:
    """The label and predicted-speedup ratio to the stock drafter of the fastest drafter in the report."""
    sections = [("the distilled drafter", report), ("the undistilled drafter", report.get("baseline_drafter") or {}),
                *((f"`{short_name(n)}`", o) for n, o in (report.get("compared_drafters") or {}).items())]
    ratios = [(label, ((s.get("against_stock") or {}).get("predicted_speedup_ratio") or {}).get("ratio"))
              for label, s in sections]
    ratios = [(label, r) for label, r in ratios if r is not None]
    return max(ratios, key=lambda item: item[1]) if ratios else ("", None)


def _timed_table(report: dict[str, Any]) -> list[str]:
    """The timed decoding table: undistilled, distilled and any compared drafters side by side."""
    base = report.get("baseline_drafter") or {}
    lines: list[str] = []
    if report.get("simulated"):
        lines += [f"## Timed decoding on {report.get('num_prompts')} of the prompts (`evaluate.timed_prompts`)", ""]
    # evaluate.compare_drafters: other (untrained) drafters measured in the same run, one column each;
    # drafters that were only simulated (evaluate.timed_drafters=distilled) have no column here
    others = {n: o for n, o in (report.get("compared_drafters") or {}).items() if o.get("timed", True)}
    columns = ([("undistilled drafter", base)] if base and base.get("timed", True) else []) + \
        [("distilled drafter", report)] + [(f"`{short_name(n)}`", o) for n, o in others.items()]
    lines += ["| figure | " + " | ".join(label for label, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for label, key, fmt in _ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(c.get(key), fmt) for _, c in columns) + " |")
    untimed = [label for label, c in (("the undistilled drafter", base),
                                      *((f"`{short_name(n)}`", o) for n, o in (report.get("compared_drafters") or {}).items()))
               if c and not c.get("timed", True)]
    if untimed:
        lines += ["", f"Not timed here (`evaluate.timed_drafters=distilled`): {', '.join(untimed)}; their predicted "
                  "speedups above come from their exact tau and their c timed side by side (`evaluate.timed_drafters=all` "
                  "decodes them in real time too)."]
    if base.get("draft_vocab_size"):
        lines += ["", f"The undistilled drafter uses the distilled one's {base['draft_vocab_size']:,}-token draft "
                  "vocabulary (the same rows of its untrained head), so the two differ by training alone."]
    if others:
        lines += ["", "The columns " + ", ".join(f"`{n}`" for n in others) + " are other drafters "
                  "(`evaluate.compare_drafters`, the stock drafter, `evaluate.compare_vocab_sizes`), as given (not "
                  "distilled by this run), measured in this run on the same prompts with the same settings and "
                  "target-alone baseline."]
    return lines


def _validation_section(report: dict[str, Any]) -> list[str]:
    """Expected (teacher-forced, validation split) against measured and simulated acceptance."""
    base = report.get("baseline_drafter") or {}
    lines: list[str] = []
    val = report.get("distill_validation")
    kind = (report.get("simulated") or {}).get("kind") or ""
    sampled_here = kind if kind.startswith("expected") else None
    # scored answers were written by someone else: greedy decoding would not emit them, so blocks replayed on
    # them are a proxy for the decoder's tau, not its exact figure
    scored_note = (" (on the dataset's answers, which the target scored but did not write: a proxy)"
                   if (report.get("data") or {}).get("answers") == "dataset" else "")
    scored_reading = ("The validation row replays greedy blocks on answers the target did not write, so it is a "
                      "proxy that tracks training; the held-out row is exact (the target's own greedy answers).")
    if val:
        lines += ["", "## Expected vs measured acceptance", "",
                  "| figure | undistilled drafter | distilled drafter |", "|---|---|---|",
                  f"| expected acceptance 1 - TV (validation split of the generated data, teacher-forced) | "
                  f"{_fmt(val.get('val_expected_acceptance_before'), '{:.3f}')} | "
                  f"{_fmt(val.get('val_expected_acceptance_after'), '{:.3f}')} |",
                  f"| top-1 agreement (drafter's argmax = target's; what greedy decoding accepts on, teacher-forced) | "
                  f"{_fmt(val.get('val_top1_agreement_before'), '{:.3f}')} | "
                  f"{_fmt(val.get('val_top1_agreement_after'), '{:.3f}')} |",
                  f"| measured acceptance rate (bundled decoder, held-out prompts) | "
                  f"{_fmt(base.get('acceptance_rate'), '{:.3f}')} | {_fmt(report.get('acceptance_rate'), '{:.3f}')} |",
                  f"| greedy tau at K = {val.get('val_simulated_draft_length') or '-'}, simulated on the validation "
                  f"split{scored_note} | {_fmt(val.get('val_simulated_tau_before'), '{:.2f}')} | "
                  f"{_fmt(val.get('val_simulated_tau_after'), '{:.2f}')} |",
                  f"| {'greedy tau' if sampled_here is None else 'tau'}, simulated on every held-out prompt "
                  f"(this report{'' if sampled_here is None else ', ' + sampled_here}) | "
                  f"{_fmt((base.get('simulated') or {}).get('mean_accepted_tokens'), '{:.2f}')} | "
                  f"{_fmt((report.get('simulated') or {}).get('mean_accepted_tokens'), '{:.2f}')} |",
                  "", "1 - TV is the acceptance probability of speculative *sampling* at temperature 1 on the "
                  "target's own continuations (Leviathan et al. 2023, Cor. 3.6); greedy acceptance on new prompts "
                  "differs, so read the two as a trend, not as equals. "
                  + (scored_reading if scored_note else
                     "The two simulated tau rows are one quantity (exact greedy blocks) on different prompts: the "
                     "validation split of the training data and the held-out set." if sampled_here is None else
                     "The validation row is greedy tau; this report's is the expectation under speculative sampling: "
                     "two different quantities.")]
        if val.get("stored_top_k"):
            lines += ["", f"Trained on the target's stored top-{val['stored_top_k']} log-probabilities: 1 - TV was "
                      f"computed on those {val['stored_top_k']} tokens plus one bucket for the rest, which is an "
                      "**upper bound** of the true value (far above it when k is small)."]
    return lines


def _engines_section(report: dict[str, Any]) -> list[str]:
    """The serving engines (``evaluate.engines``): measured and predicted speedups, per drafter and K."""
    if not report.get("engines"):
        return []
    return ["", f"## Serving engines, on the {report.get('num_prompts')} timed prompts (`evaluate.engines`)", "",
            "Predicted: the drafter's exact tau at K (every held-out prompt) over the engine's own measured costs "
            "(its decoding step, the drafter's, its (K+1)-token verification). Tokens/s are one request at a time.",
            "", *engines_table(report["engines"])]


def _hf_assisted_section(report: dict[str, Any]) -> list[str]:
    """transformers' assisted generation with the same drafter and K, and the baseline's engine."""
    lines: list[str] = []
    hf = (report.get("baselines") or {}).get("hf_assisted")
    if hf:
        lines += ["", "## Transformers assisted generation, same distilled drafter and K", "",
                  "| tokens/s | speedup vs target | output identical to target | ours / HF assisted |", "|---|---|---|---|",
                  f"| {_fmt(hf.get('tokens_per_s'), '{:.2f}')} | {_fmt(hf.get('speedup'), '{:.2f}x')} | "
                  f"{_fmt(hf.get('outputs_match_target'), '{}')} | "
                  f"{_fmt(ratio_or_none(report.get('speculative_tokens_per_s'), hf.get('tokens_per_s')), '{:.2f}x')} |"]
    target_base = (report.get("baselines") or {}).get("target") or {}
    if target_base.get("engine"):
        lines += ["", f"Target alone measured with {target_base['engine']}."]
    return lines


def _draft_length_section(report: dict[str, Any]) -> list[str]:
    """The recommended K and the expected speedup at every K."""
    lines: list[str] = []
    choice = report.get("draft_length_choice")
    if choice:
        by_k = choice.get("expected_speedup_by_k") or {}
        lines += ["", "## Choice of draft length K (distilled drafter)", "",
                  f"Recommended K = {choice.get('best_draft_length')} from the acceptance at each K "
                  f"({choice.get('source', 'measured per position')}), "
                  f"c = {_fmt(choice.get('cost_ratio'), '{:.3f}')} and the measured verification cost; the "
                  f"article's rule of thumb K = max(2, int(accuracy x 5)) gives K = {choice.get('rule_of_thumb')}. "
                  + (f"Acceptance was measured up to position {choice['measured_positions']}; larger K "
                     f"extrapolate it with the mean measured value (use decode.schedule=auto to measure them). "
                     if choice.get("measured_positions") else "")
                  + ("" if choice.get("speculation_pays") else
                     "**No K is expected to beat the target alone with this pair on this machine.**")
                  + _decoded_at(report), "",
                  "| K | " + " | ".join(str(k) for k in by_k) + " |", "|---|" + "---|" * len(by_k),
                  "| expected speedup | " + " | ".join(_fmt(v, "{:.2f}x") for v in by_k.values()) + " |"]
    return lines


def _decoded_at(report: dict[str, Any]) -> str:
    """Where the timed runs' K came from, when evaluate chose it (``evaluate.draft_length=recommended``)."""
    chosen = report.get("draft_length_from")
    if not chosen:
        return ""
    by_k = {int(k): v for k, v in (chosen.get("predicted_speedup_by_k") or {}).items()}
    configured = chosen.get("decode_draft_length")
    return (f" The timed runs decoded at K = {chosen.get('chosen')}, chosen this way before them on the same "
            f"{chosen.get('num_prompts')} prompts (`evaluate.draft_length=recommended`; decode.draft_length = "
            f"{configured} predicted {_fmt(by_k.get(configured), '{:.2f}x')}).")


def _per_category_section(report: dict[str, Any]) -> list[str]:
    """The distilled drafter's figures per prompt category."""
    lines: list[str] = []
    per_cat = report.get("per_category") or {}
    if per_cat:
        lines += ["", "## Per prompt category (distilled drafter)", "",
                  "| category | prompts | acceptance | tau | tokens/s | speedup | theoretical | measured / theoretical |",
                  "|---|---|---|---|---|---|---|---|"]
        for cat, fig in sorted(per_cat.items()):
            lines.append(f"| {cat} | {fig.get('num_prompts', '-')} | {_fmt(fig.get('acceptance_rate'), '{:.3f}')} | "
                         f"{_fmt(fig.get('mean_accepted_tokens'), '{:.2f}')} | "
                         f"{_fmt(fig.get('speculative_tokens_per_s'), '{:.2f}')} | {_fmt(fig.get('speedup'), '{:.2f}x')} | "
                         f"{_fmt(fig.get('theoretical_speedup'), '{:.2f}x')} | "
                         f"{_fmt(fig.get('measured_over_theoretical'), '{:.2f}')} |")
    return lines


def per_position(section: dict[str, Any]) -> tuple[list | None, str]:
    """A drafter's P(accepted | reached) by draft position and where it comes from: the simulation over every
    held-out prompt when the report has one, else the timed decoding."""
    simulated = (section.get("simulated") or {}).get("per_position_acceptance")
    if simulated:
        return simulated, f"simulated on all {section['simulated'].get('num_prompts')} prompts"
    return section.get("per_position_acceptance"), f"timed decoding, {section.get('num_prompts')} prompts"


def _per_position_section(report: dict[str, Any]) -> list[str]:
    """P(accepted | reached) by draft position, undistilled against distilled."""
    base = report.get("baseline_drafter") or {}
    lines: list[str] = []
    pos, source = per_position(report)
    if pos:
        base_pos = per_position(base)[0] or [None] * len(pos)
        lines += ["", f"## Acceptance by draft position (P(accepted | reached); {source})", "",
                  "| position | undistilled | distilled |", "|---|---|---|"]
        for i, (b, t) in enumerate(zip(base_pos, pos), start=1):
            lines.append(f"| {i} | {_fmt(b, '{:.3f}')} | {_fmt(t, '{:.3f}')} |")
    return lines


def _stages_section(report: dict[str, Any]) -> list[str]:
    """Wall time and peak memory of each pipeline stage, and where evaluate's time went."""
    lines: list[str] = []
    stages = report.get("stages")
    if stages:
        lines += ["", "## Pipeline stages", "", "| stage | wall time (s) | process peak RSS so far (GiB) |", "|---|---|---|"]
        for name, fig in stages.items():
            name = (f"{name} (given: {fig['given']})" if fig.get("given") else
                    f"{name} (reused: {fig['reused']}, not trained again)" if fig.get("reused") else name)
            lines.append(f"| {name} | {_fmt(fig.get('wall_s'), '{:.1f}')} | "
                         f"{_fmt((fig.get('peak_rss_bytes') or 0) / 2**30, '{:.2f}')} |")
    phases = report.get("phase_seconds")
    if phases:
        lines += ["", "Evaluate's phases (wall s): " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                                                                  for k, v in phases.items()) + "."]
    return lines


def _plots_and_notes(report: dict[str, Any]) -> list[str]:
    """The PNG plots and the report's notes."""
    lines: list[str] = []
    plots = report.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    notes = report.get("notes") or []
    if notes:
        lines += ["", "Notes:"] + [f"- {note}" for note in notes]
    return lines


def write_report_plots(report: dict[str, Any], folder: Path, training_metrics: Path | None = None) -> list[Path]:
    """PNG plots beside the report: acceptance by draft position, tokens/s per method, expected and
    measured speedup vs K, expected (1 - TV) vs measured acceptance, training loss.

    Args:
        training_metrics: the distill run's ``metrics.jsonl`` (one JSON object per step with ``loss``
            and ``expected_acceptance``); the loss plot is skipped when it is missing.
    Returns:
        the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    folder = Path(folder)
    base = report.get("baseline_drafter") or {}

    plots = [plot(plt, report, base, folder) for plot in (_plot_acceptance_by_position, _plot_tokens_per_s,
                                                        _plot_speedup_vs_k, _plot_expected_vs_measured,
                                                        _plot_simulated_vs_k)]
    plots.append(_plot_training(plt, report, base, folder, training_metrics))
    plots.append(plot_budget_curve(plt, report, folder, _save))
    return [path for path in plots if path is not None]


def write_budget_plot(report: dict[str, Any], folder: Path) -> Path | None:
    """``budget_curve.png`` alone (:func:`distill.measure.budget.plot_budget_curve`), for reports without the
    other plots (a head's); None without a curve of two trained points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plot_budget_curve(plt, report, Path(folder), _save)


def _save(plt, fig, path: Path) -> None:
    """Write ``fig`` as a PNG to ``path`` atomically and close it: a full disk ends with one
    :class:`~distill.errors.DiskFullError` line and no cut image (matplotlib's own write gives a traceback)."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_bytes_atomic(path, buffer.getvalue())


def _plot_acceptance_by_position(plt, report: dict[str, Any], base: dict[str, Any], folder: Path) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    pos, source = per_position(report)
    if pos:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        xs = list(range(1, len(pos) + 1))
        width = 0.38
        for offset, (label, values) in zip((-width / 2, width / 2), (("undistilled", per_position(base)[0]),
                                                                     ("distilled", pos))):
            if values:
                ax.bar([x + offset for x in xs], [v or 0.0 for v in values], width, label=label)
        ax.set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1), xticks=xs,
               title=f"Acceptance by position, K = {report.get('draft_length')}\n({source})")
        ax.legend()
        fig.tight_layout()
        path = folder / "acceptance_by_position.png"
        _save(plt, fig, path)
        return path
    return None


def _plot_tokens_per_s(plt, report: dict[str, Any], base: dict[str, Any], folder: Path) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    hf = (report.get("baselines") or {}).get("hf_assisted") or {}
    bars = [("target alone", report.get("target_tokens_per_s")), ("HF assisted\n(distilled)", hf.get("tokens_per_s")),
            ("ours\n(undistilled)", base.get("speculative_tokens_per_s")),
            ("ours\n(distilled)", report.get("speculative_tokens_per_s"))]
    bars += [(f"ours\n({short_name(name)[-18:]})", other.get("speculative_tokens_per_s"))
             for name, other in (report.get("compared_drafters") or {}).items()]
    bars = [(label, value) for label, value in bars if isinstance(value, (int, float))]
    if bars:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["grey"] + ["C0"] * (len(bars) - 1))
        ax.set(ylabel="decode tokens/s", title="Decoding speed on held-out prompts")
        fig.tight_layout()
        path = folder / "tokens_per_s.png"
        _save(plt, fig, path)
        return path
    return None


def _plot_speedup_vs_k(plt, report: dict[str, Any], base: dict[str, Any], folder: Path) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    curves = [(label, (r.get("draft_length_choice") or {}).get("expected_speedup_by_k"), r)
              for label, r in (("undistilled", base), ("distilled", report))]
    curves = [(label, by_k, r) for label, by_k, r in curves if by_k]
    if curves:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        for i, (label, by_k, r) in enumerate(curves):
            ks = [int(k) for k in by_k]
            ax.plot(ks, list(by_k.values()), marker="o", color=f"C{i}", label=f"{label}: expected")
            if isinstance(r.get("speedup"), (int, float)):
                ax.scatter([r.get("draft_length")], [r["speedup"]], marker="*", s=120, color=f"C{i}",
                           label=f"{label}: measured", zorder=3)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="draft length K", ylabel="speedup vs target alone",
               title="Speedup vs K (simulated acceptance, measured c, verify cost)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / "speedup_vs_k.png"
        _save(plt, fig, path)
        return path
    return None


def _plot_expected_vs_measured(plt, report: dict[str, Any], base: dict[str, Any], folder: Path) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    val = report.get("distill_validation") or {}
    if val.get("val_expected_acceptance_after") is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        labels = ["undistilled", "distilled"]
        expected = [val.get("val_expected_acceptance_before") or 0.0, val.get("val_expected_acceptance_after") or 0.0]
        exact = [(s.get("simulated") or {}).get("acceptance_rate") for s in (base, report)]
        if None not in exact:  # exact on every held-out prompt; the timed figures cover a few, and only timed drafters
            measured, measured_label = exact, "measured (exact, every held-out prompt)"
        else:
            measured = [base.get("acceptance_rate") or 0.0, report.get("acceptance_rate") or 0.0]
            measured_label = "measured (decoder, held-out)"
        top1 = [val.get("val_top1_agreement_before"), val.get("val_top1_agreement_after")]
        xs = range(len(labels))
        series = [("expected 1 - TV (validation)", expected)]
        if None not in top1:  # reports from before the top-1 figure existed lack it
            series.append(("top-1 agreement (validation)", top1))
        series.append((measured_label, measured))
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], values, width, label=label)
        ax.set(xticks=list(xs), xticklabels=labels, ylim=(0, 1), ylabel="acceptance",
               title="Expected vs measured acceptance")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = folder / "expected_vs_measured_acceptance.png"
        _save(plt, fig, path)
        return path
    return None


def _plot_simulated_vs_k(plt, report: dict[str, Any], base: dict[str, Any], folder: Path) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    simulated = simulated_drafters(report)
    if simulated:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
        for i, (label, sim) in enumerate(simulated.items()):
            ks = sorted(int(k) for k in sim.get("per_k") or {})
            ax.plot(ks, [sim["per_k"][str(k)]["mean_accepted_tokens"] for k in ks], marker=".", color=f"C{i}",
                    label=label.strip("`"))
            speedups = [sim["per_k"][str(k)].get("predicted_speedup") for k in ks]
            if all(v is not None for v in speedups):
                ax2.plot(ks, speedups, marker=".", color=f"C{i}", label=label.strip("`"))
        ax.set(xlabel="draft length K", ylabel="tau (tokens per target forward)", ylim=(0, None),
               title=f"simulated, {next(iter(simulated.values())).get('num_prompts')} prompts")
        ax2.axhline(1.0, color="black", lw=0.6)
        ax2.set(xlabel="draft length K", ylabel="predicted speedup", ylim=(0, None), title="with measured c, verify cost")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / "simulated_vs_k.png"
        _save(plt, fig, path)
        return path
    return None


def _plot_training(plt, report: dict[str, Any], base: dict[str, Any], folder: Path, training_metrics) -> Path | None:
    """One plot of :func:`write_report_plots` into ``folder``; its path, or None when the report lacks its figures."""
    if training_metrics is not None and Path(training_metrics).is_file():
        import json

        rows = [json.loads(line) for line in Path(training_metrics).read_text().splitlines() if line.strip()]
        if rows:
            fig, ax = plt.subplots(figsize=(5.5, 3.2))
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="loss")
            ax.set(xlabel="step", ylabel="distillation loss", title="Training")
            ax2 = ax.twinx()
            ax2.plot([r["step"] for r in rows], [r.get("expected_acceptance") for r in rows], color="C1",
                     label="expected acceptance (1 - TV)")
            validation = Path(training_metrics).with_name("validation.jsonl")  # distill.validate_every
            points = [json.loads(line) for line in validation.read_text().splitlines() if line.strip()] \
                if validation.is_file() else []
            if points:
                ax.plot([p["step"] for p in points], [p.get("val_loss") for p in points], "o--", color="C0",
                        alpha=0.6, label="validation loss")
                ax2.plot([p["step"] for p in points], [p.get("val_expected_acceptance") for p in points], "^--",
                         color="C1", alpha=0.6, label="validation 1 - TV")
                ax2.plot([p["step"] for p in points], [p.get("val_top1_agreement") for p in points], "s--",
                         color="C2", label="validation top-1 agreement")
                if any(p.get("val_simulated_acceptance") is not None for p in points):
                    ax2.plot([p["step"] for p in points], [p.get("val_simulated_acceptance") for p in points],
                             "d-", color="C3", label="validation acceptance (simulated greedy decoder)")
            ax2.set(ylabel="expected acceptance / agreement", ylim=(0, 1))
            handles = ax.get_lines() + ax2.get_lines()
            ax.legend(handles, [h.get_label() for h in handles], loc="center right", fontsize=8)
            fig.tight_layout()
            path = folder / "training.png"
            _save(plt, fig, path)
            return path
    return None


def ratio_or_none(a: Any, b: Any) -> float | None:
    """``a / b`` when both are numbers and ``b`` is not 0, else None (a figure missing from a report)."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def write_report_markdown(report: dict[str, Any], path: Path) -> Path:
    """Render ``report`` to ``path`` atomically; returns ``path``."""
    write_text_atomic(path, render_report_markdown(report))
    return path


REPORT_JSON = "report.json"


REPORT_MD = "report.md"
