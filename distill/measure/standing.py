"""Where a run stands on the measured budget curve: its training tokens and gain beside the reference curve.

A run without checkpoints (the default pipeline) measures one point. ``reference_curve.json`` holds a curve
measured with :mod:`distill.measure.budget` (one distill run's checkpoints, one evaluate, the same held-out
prompts; RESULTS.md gives the commands): the recipe, the data, the host and, per training budget, the paired
tau difference and the predicted-speedup ratio to the stock drafter with 95% intervals. report.md's section
puts the run's own figures beside the reference's nearest points and says what the reference's fit predicts
for ten times the tokens. The reference was measured elsewhere: it is context for the run, never a figure of
it, and the section names where the two differ (recipe, prompts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

REFERENCE_CURVE = Path(__file__).with_name("reference_curve.json")


def load_reference(path: Path = REFERENCE_CURVE) -> dict[str, Any] | None:
    """The reference curve (``{"recipe": {...}, "points": [...], "fit": {...}, ...}``), or None where the file
    is absent or unreadable (the section is then left out)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def standing(report: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any] | None:
    """``report.json``'s ``curve_standing``: the run's training tokens and its gain over the stock drafter, the
    reference's two points nearest in log tokens, and the reference fit's ratio at the run's tokens and at ten
    times them (an extrapolation). None without a reference or without the run's training tokens.

    Args:
        report: evaluate's report with ``training`` (``{"tokens", "recipe"}``) and ``against_stock``.
        reference: :func:`load_reference`'s curve.
    """
    training = report.get("training") or {}
    tokens = training.get("tokens")
    if not reference or not tokens:
        return None
    against = report.get("against_stock") or {}
    points = [p for p in reference.get("points") or [] if p.get("training_tokens")]
    nearest = sorted(points, key=lambda p: abs(math.log10(p["training_tokens"]) - math.log10(tokens)))[:2]
    fit = reference.get("fit") or {}
    return {
        "training_tokens": tokens,
        "tau_minus_stock": against.get("tau_difference"),
        "predicted_speedup_ratio_to_stock": against.get("predicted_speedup_ratio"),
        "reference": {k: reference.get(k) for k in ("recipe", "data", "held_out", "host", "source")},
        "recipe_differs": _recipe_differences(training.get("recipe") or {}, reference.get("recipe") or {}),
        "nearest_reference_points": sorted(nearest, key=lambda p: p["training_tokens"]),
        "reference_fit_ratio": {str(n): _fit_at(fit, n) for n in (tokens, 10 * tokens)} if fit else None,
    }


def _recipe_differences(run: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The recipe keys (method, lr, loss, ...) where the run's settings are not the reference's."""
    return [key for key, value in reference.items() if key in run and run[key] != value]


def _fit_at(fit: dict[str, Any], tokens: float) -> float | None:
    """The reference fit's predicted-speedup ratio to stock at ``tokens`` (a line in log10 tokens)."""
    if fit.get("slope_per_decade") is None:
        return None
    return fit["intercept"] + fit["slope_per_decade"] * math.log10(tokens)


def standing_lines(report: dict[str, Any]) -> list[str]:
    """report.md's section "Where this run stands on the budget curve"; nothing where ``curve_standing`` is
    absent (no reference, or a run that measured its own curve)."""
    s = report.get("curve_standing")
    if not s:
        return []
    ref = s["reference"]
    diff, ratio = s.get("tau_minus_stock") or {}, s.get("predicted_speedup_ratio_to_stock") or {}
    lines = ["", "## Where this run stands on the budget curve", "",
             f"This drafter trained on {s['training_tokens']:,} tokens. Against the stock drafter on this run's "
             f"prompts: tau {_signed(diff.get('mean_accepted_tokens'), diff.get('ci95'))}, predicted-speedup ratio "
             f"{_plain(ratio.get('ratio'), ratio.get('ci95'))}.", "",
             f"The reference curve ({ref.get('source') or 'reference_curve.json'}): {_describe(ref)}.", "",
             "| reference drafter | training tokens | tau minus stock | predicted speedup ratio to stock |",
             "|---|---|---|---|"]
    for p in s["nearest_reference_points"]:
        d, r = p.get("tau_minus_stock") or {}, p.get("predicted_speedup_ratio_to_stock") or {}
        lines.append(f"| {p.get('drafter', '-')} | {p['training_tokens']:,} | {_signed(d.get('mean'), d.get('ci95'))} "
                     f"| {_plain(r.get('ratio'), r.get('ci95'))} |")
    fit = s.get("reference_fit_ratio")
    if fit:
        (here, at_here), (more, at_more) = list(fit.items())
        lines += ["", f"The reference's fitted line gives a ratio of {_plain(at_here)} at {int(here):,} tokens and "
                      f"{_plain(at_more)} at {int(more):,} (ten times them; an extrapolation, not a measurement)."]
    if s.get("recipe_differs"):
        lines += ["", "This run's recipe differs from the reference's in " + ", ".join(
            f"`{k}`" for k in s["recipe_differs"]) + ": read the reference as context only."]
    return lines


def _describe(ref: dict[str, Any]) -> str:
    recipe = ref.get("recipe") or {}
    parts = [", ".join(f"{k} {v}" for k, v in recipe.items()), ref.get("data"), ref.get("held_out"), ref.get("host")]
    return "; ".join(str(p) for p in parts if p)


def _signed(value: float | None, ci: list[float] | None = None) -> str:
    return _plain(value, ci, "{:+.3f}")


def _plain(value: float | None, ci: list[float] | None = None, fmt: str = "{:.3f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")


RECIPE_KEYS = ("method", "loss", "lr", "lr_schedule")  # distill settings whose change moves the curve


def training_recipe(distill_dir: Path) -> dict[str, Any]:
    """The distill run's ``RECIPE_KEYS`` and ``draft_vocab_size`` from its ``config.yaml`` ({} where it cannot
    be read), to compare with the reference curve's recipe."""
    import yaml

    try:
        config = yaml.safe_load((Path(distill_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    distill = config.get("distill") or {}
    recipe = {k: distill[k] for k in RECIPE_KEYS if k in distill}
    if "draft_vocab_size" in (config.get("drafter") or {}):
        recipe["draft_vocab_size"] = config["drafter"]["draft_vocab_size"]
    return recipe


def reference_from_report(report: dict[str, Any], data: str, source: str) -> dict[str, Any]:
    """``reference_curve.json``'s content from an evaluate report that measured its own ``budget_curve``
    (``evaluate.checkpoints``): its trained points, fit and held-out set as measured, the host from its
    ``hardware``, the recipe from its ``training``; ``data`` and ``source`` describe the training data and
    where the curve is written up.

    Raises:
        ValueError: the report holds no budget curve with trained points.
    """
    curve = report.get("budget_curve") or {}
    points = [p for p in curve.get("points") or [] if p["training_tokens"] > 0]
    if not points:
        raise ValueError("the report holds no budget curve: evaluate with evaluate.checkpoints=true on a distill "
                         "run with distill.checkpoint_at=[...]")
    sim, host = report.get("simulated") or {}, report.get("hardware") or {}
    units = "bf16 units" if host.get("bf16_fast") else "no bf16 units"
    return {
        "recipe": {**(report.get("training") or {}).get("recipe", {})},
        "data": data,
        "held_out": f"{sim.get('num_prompts')} prompts, exact greedy, K = {sim.get('draft_length')}",
        "host": f"{host.get('cpu_count')} cores, {host.get('cpu_capability')}, {units}, gpu {host.get('gpu')}",
        "source": source,
        "points": [{"drafter": p["drafter"], "training_tokens": p["training_tokens"],
                    "tau_minus_stock": p["tau_minus_undistilled"],
                    "predicted_speedup_ratio_to_stock": p["predicted_speedup_ratio_to_stock"]} for p in points],
        "fit": {k: (curve.get("fit") or {}).get(k) for k in ("of", "points", "slope_per_decade", "intercept")},
    }
