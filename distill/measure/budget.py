"""What a training budget buys: acceptance, tau and the predicted speedup against training tokens.

One distill run's checkpoints (``distill.checkpoint_at`` with ``distill.lr_schedule=constant``) measured by one
evaluate (``evaluate.checkpoints=true``) on the same held-out prompts, beside the undistilled drafter (0 tokens)
and the final one: ``report.json`` ``budget_curve``, a table in report.md and ``budget_curve.png``. Training
tokens are completion tokens trained on, repeats included (``metrics.jsonl``'s count).

The trend is a least-squares line of the predicted-speedup ratio to the stock drafter against log10(training
tokens) over the trained points: an empirical first look, not a law. The budgets it predicts for a ratio of
1.10 and 1.25 are an extrapolation, stated as such, and None where the line does not rise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

FLAT_LINE_FACTOR = 1000  # budgets beyond this many times the largest measured one are not worth stating
TARGET_RATIOS = (1.10, 1.25)  # the budgets a user asks for: +10% and +25% over the stock drafter's speed


def budget_curve(report: dict[str, Any], checkpoints: dict[str, dict[str, int]], final: dict[str, int],
                 tokens_per_s: float | None) -> dict[str, Any]:
    """The ``budget_curve`` section of ``report``.

    Args:
        report: evaluate's report with the checkpoints measured as ``compared_drafters`` entries named as in
            ``checkpoints``, the undistilled drafter as ``baseline_drafter`` and the final one at its top level.
        checkpoints: ``{name: {"step", "tokens_seen", ...}}`` (:func:`distill.training.checkpoint.checkpoint_tokens`).
        final: ``{"step", "tokens_seen"}`` of the final drafter (the distill manifest's ``train``).
        tokens_per_s: training tokens per second of the distill run (its ``train.tokens_per_s``), for hours.

    Returns:
        ``{"points": [...] by training tokens, "fit": {...} or None, "stock": name}``; each point holds
        ``drafter``, ``training_tokens``, ``step``, ``acceptance_rate``, ``mean_accepted_tokens`` (tau) with
        ``ci95``, ``draft_length``, ``tau_minus_undistilled`` and ``predicted_speedup_ratio_to_stock`` (with
        ``ci95``; exactly 1 for the stock drafter itself).
    """
    compared = report.get("compared_drafters") or {}
    rows = [("undistilled", report.get("baseline_drafter"), {"step": 0, "tokens_seen": 0})]
    rows += [(name, compared.get(name), info) for name, info in checkpoints.items()]
    rows.append(("distilled", report, final))
    stock = report.get("drafter_stock")
    points = [_point(name, section, info, stock) for name, section, info in rows if section]
    points.sort(key=lambda p: p["training_tokens"])
    return {"points": points, "stock": stock, "fit": _fit(points, tokens_per_s)}


def warn_no_checkpoints(distill_dir: Path) -> None:
    """Say that ``evaluate.checkpoints`` found no budget point in ``distill_dir`` and how to get some."""
    print(f"evaluate: warning: evaluate.checkpoints: {distill_dir} kept no checkpoint before its last step "
          "(distill with distill.checkpoint_at=[...] or distill.keep_checkpoints=0); only the final drafter "
          "is measured", flush=True)


def _point(name: str, section: dict[str, Any], info: dict[str, Any], stock: str | None) -> dict[str, Any]:
    """One row of the curve from a drafter's report section."""
    sim = section.get("simulated") or {}
    ci = sim.get("ci95") or {}
    against = section.get("against_stock") or {}
    ratio = against.get("predicted_speedup_ratio") or {}
    if name == stock:
        ratio = {"ratio": 1.0, "ci95": [1.0, 1.0]}
    diff = section.get("paired_difference") if name != "undistilled" else {"mean_accepted_tokens": 0.0,
                                                                            "ci95": [0.0, 0.0]}
    return {"drafter": name, "training_tokens": int(info["tokens_seen"]), "step": info.get("step"),
            "acceptance_rate": sim.get("acceptance_rate"), "acceptance_ci95": ci.get("acceptance_rate"),
            "mean_accepted_tokens": sim.get("mean_accepted_tokens"), "tau_ci95": ci.get("mean_accepted_tokens"),
            "draft_length": sim.get("draft_length"),
            "tau_minus_undistilled": ({"mean": diff["mean_accepted_tokens"], "ci95": diff["ci95"]} if diff else None),
            "predicted_speedup_ratio_to_stock": ({"ratio": ratio["ratio"], "ci95": ratio["ci95"]} if ratio else None)}


def _fit(points: list[dict[str, Any]], tokens_per_s: float | None) -> dict[str, Any] | None:
    """Least squares of the ratio to stock on log10(tokens) over the trained points; None with fewer than 2."""
    xy = [(math.log10(p["training_tokens"]), p["predicted_speedup_ratio_to_stock"]["ratio"]) for p in points
          if p["training_tokens"] > 0 and p["predicted_speedup_ratio_to_stock"]]
    if len({x for x, _ in xy}) < 2:
        return None
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
    intercept = my - slope * mx
    budgets = {}
    for target in TARGET_RATIOS:
        tokens = 10 ** ((target - intercept) / slope) if slope > 0 else None
        hours = tokens / tokens_per_s / 3600 if tokens is not None and tokens_per_s else None
        budgets[f"{target:.2f}"] = {"tokens": tokens, "hours_at_this_run_rate": hours}
    return {"of": "predicted speedup ratio to stock = intercept + slope * log10(training tokens), least squares "
                  "over the trained points", "points": len(xy), "slope_per_decade": slope, "intercept": intercept,
            "budget_for_ratio": budgets, "tokens_per_s": tokens_per_s,
            "largest_tokens": max(p["training_tokens"] for p in points)}


def budget_curve_lines(report: dict[str, Any]) -> list[str]:
    """report.md's section: one row per training budget, the fit and the budgets it predicts."""
    curve = report.get("budget_curve")
    if not curve or not curve.get("points"):
        return []
    lines = ["", "## Training budget", "",
             f"Each checkpoint of the distill run measured on the same {_num_prompts(report)} prompts "
             "(exact simulation; intervals 95% over prompts, the ratio's also over c's timing rounds). Training "
             "tokens are completion tokens trained on, repeats included.", "",
             "| drafter | training tokens | acceptance | tau | tau minus undistilled | "
             "predicted speedup ratio to stock |", "|---|---|---|---|---|---|"]
    for p in curve["points"]:
        diff, ratio = p.get("tau_minus_undistilled"), p.get("predicted_speedup_ratio_to_stock")
        lines.append(f"| {p['drafter']} | {p['training_tokens']:,} | {_ci(p['acceptance_rate'], p['acceptance_ci95'])} "
                     f"| {_ci(p['mean_accepted_tokens'], p['tau_ci95'], '{:.2f}')} "
                     f"| {_ci(diff and diff['mean'], diff and diff['ci95'], '{:+.3f}')} "
                     f"| {_ci(ratio and ratio['ratio'], ratio and ratio['ci95'])} |")
    fit = curve.get("fit")
    if fit:
        lines += ["", f"Fitted over {fit['points']} trained points: the ratio moves {fit['slope_per_decade']:+.3f} "
                      "per tenfold training tokens. " + _budget_sentence(fit)]
    return lines


def _budget_sentence(fit: dict[str, Any]) -> str:
    """What the fit predicts for +10% and +25%, in tokens and hours at this run's rate, or why it cannot."""
    if fit["slope_per_decade"] <= 0:
        return "The line does not rise, so it predicts no budget for a gain (more tokens of this data and recipe " \
               "are not shown to help)."
    largest = fit.get("largest_tokens")
    if largest and all((b.get("tokens") or 0) > FLAT_LINE_FACTOR * largest for b in fit["budget_for_ratio"].values()):
        return (f"The line rises too little to predict a budget: it would reach 1.10x only beyond {FLAT_LINE_FACTOR:,}x "
                f"the largest budget measured ({largest:,} tokens), so more tokens of this data and recipe are not "
                "shown to help.")
    parts = []
    for target, budget in fit["budget_for_ratio"].items():
        hours = budget.get("hours_at_this_run_rate")
        parts.append(f"{target}x at about {budget['tokens']:.3g} tokens"
                     + (f" ({hours:.3g} h at this run's training rate)" if hours is not None else ""))
    return "Extrapolated along the line (a straight line in log tokens, not a law): " + "; ".join(parts) + "."


def _num_prompts(report: dict[str, Any]) -> Any:
    """The prompts the curve was simulated on (the report's top-level count is the timed subset's)."""
    curve = report.get("budget_curve") or {}
    return curve.get("num_prompts") or (report.get("simulated") or {}).get("num_prompts", report.get("num_prompts"))


def _ci(value: float | None, ci: list[float] | None, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "-"
    text = fmt.format(value)
    return text + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")


def plot_budget_curve(plt, report: dict[str, Any], folder: Path, save) -> Path | None:
    """``budget_curve.png``: tau and the predicted speedup ratio to stock against training tokens (log axis),
    with 95% intervals, the untrained drafter as a dashed line; None without a curve of two trained points."""
    curve = report.get("budget_curve") or {}
    trained = [p for p in curve.get("points") or [] if p["training_tokens"] > 0]
    if len(trained) < 2:
        return None
    untrained = next((p for p in curve["points"] if p["training_tokens"] == 0), None)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tau", "tau (mean accepted tokens per target forward)"),
                           (axes[1], "ratio", "predicted speedup ratio to stock")):
        xs = [p["training_tokens"] for p in trained]
        ys, los, his = zip(*(_value_and_ci(p, key) for p in trained))
        ax.errorbar(xs, ys, yerr=[[y - lo for y, lo in zip(ys, los)], [hi - y for y, hi in zip(ys, his)]],
                    marker="o", capsize=3, label="distilled")
        if untrained is not None:
            ax.axhline(_value_and_ci(untrained, key)[0], linestyle="--", color="gray", label="untrained")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"training budget ({_num_prompts(report)} prompts, "
                 f"K = {curve.get('draft_length') or report.get('draft_length')})")
    fig.tight_layout()
    path = Path(folder) / "budget_curve.png"
    save(plt, fig, path)
    return path


def _value_and_ci(point: dict[str, Any], key: str) -> tuple[float, float, float]:
    """``(value, low, high)`` of a point's tau or ratio (the interval collapsed onto the value where missing)."""
    if key == "tau":
        value, ci = point["mean_accepted_tokens"], point.get("tau_ci95")
    else:
        ratio = point.get("predicted_speedup_ratio_to_stock") or {"ratio": float("nan"), "ci95": None}
        value, ci = ratio["ratio"], ratio.get("ci95")
    return (value, *(ci or (value, value)))
