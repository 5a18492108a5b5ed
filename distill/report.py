"""Markdown rendering of ``report.json``: the figures people compare, readable without JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distill.rundir import write_text_atomic

_ROWS = [  # (label, key, format)
    ("acceptance rate alpha", "acceptance_rate", "{:.3f}"),
    ("mean accepted tokens per target forward tau (incl. bonus)", "mean_accepted_tokens", "{:.2f}"),
    ("speculative tokens/s", "speculative_tokens_per_s", "{:.2f}"),
    ("target alone tokens/s", "target_tokens_per_s", "{:.2f}"),
    ("speedup vs target alone", "speedup", "{:.2f}x"),
    ("cost ratio c (drafter / target forward)", "cost_ratio", "{:.3f}"),
    ("theoretical speedup (alpha, K, c)", "theoretical_speedup", "{:.2f}x"),
    ("greedy output identical to target", "outputs_match_target", "{}"),
]


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def render_report_markdown(report: dict[str, Any]) -> str:
    """A Markdown page: the before/after table, HF assisted baseline, per-category and per-position figures."""
    base = report.get("baseline_drafter") or {}
    lines = [
        "# draftsmith evaluation report", "",
        f"Target `{report.get('target', {}).get('name')}`, drafter from `{report.get('drafter', {}).get('base_name')}` "
        f"({report.get('drafter', {}).get('init')}), draft length K = {report.get('draft_length')}, "
        f"{report.get('num_prompts')} held-out prompts, {report.get('new_tokens')} new tokens. "
        f"Engine: {report.get('engine')}.", "",
        "| figure | undistilled drafter | distilled drafter |", "|---|---|---|",
    ]
    for label, key, fmt in _ROWS:
        lines.append(f"| {label} | {_fmt(base.get(key), fmt)} | {_fmt(report.get(key), fmt)} |")
    hf = (report.get("baselines") or {}).get("hf_assisted")
    if hf:
        lines += ["", "## Transformers assisted generation, same distilled drafter and K", "",
                  "| tokens/s | speedup vs target | output identical to target | ours / HF assisted |", "|---|---|---|---|",
                  f"| {_fmt(hf.get('tokens_per_s'), '{:.2f}')} | {_fmt(hf.get('speedup'), '{:.2f}x')} | "
                  f"{_fmt(hf.get('outputs_match_target'), '{}')} | "
                  f"{_fmt(_ratio(report.get('speculative_tokens_per_s'), hf.get('tokens_per_s')), '{:.2f}x')} |"]
    per_cat = report.get("per_category") or {}
    if per_cat:
        lines += ["", "## Per prompt category (distilled drafter)", "",
                  "| category | prompts | alpha | tau | speedup |", "|---|---|---|---|---|"]
        for cat, fig in sorted(per_cat.items()):
            lines.append(f"| {cat} | {fig.get('num_prompts', '-')} | {_fmt(fig.get('acceptance_rate'), '{:.3f}')} | "
                         f"{_fmt(fig.get('mean_accepted_tokens'), '{:.2f}')} | {_fmt(fig.get('speedup'), '{:.2f}x')} |")
    pos = report.get("per_position_acceptance")
    if pos:
        base_pos = base.get("per_position_acceptance") or [None] * len(pos)
        lines += ["", "## Acceptance by draft position (P(accepted | reached))", "",
                  "| position | undistilled | distilled |", "|---|---|---|"]
        for i, (b, t) in enumerate(zip(base_pos, pos), start=1):
            lines.append(f"| {i} | {_fmt(b, '{:.3f}')} | {_fmt(t, '{:.3f}')} |")
    stages = report.get("stages")
    if stages:
        lines += ["", "## Pipeline stages", "", "| stage | wall time (s) | peak RSS (GiB) |", "|---|---|---|"]
        for name, fig in stages.items():
            lines.append(f"| {name} | {_fmt(fig.get('wall_s'), '{:.1f}')} | "
                         f"{_fmt((fig.get('peak_rss_bytes') or 0) / 2**30, '{:.2f}')} |")
    notes = report.get("notes") or []
    if notes:
        lines += ["", "Notes:"] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def write_report_markdown(report: dict[str, Any], path: Path) -> Path:
    """Render ``report`` to ``path`` atomically; returns ``path``."""
    write_text_atomic(path, render_report_markdown(report))
    return path
