"""``draftsmith gather``: one table and plots for a Hydra multirun sweep.

A sweep (``draftsmith pipeline -m distill.loss=fkl,jsd decode.draft_length=2,4``)
writes one folder per job under ``outputs/multirun/<stage>/<time>/``, each
with Hydra's ``.hydra/overrides.yaml`` and, once finished, a ``report.json``
(``evaluate`` jobs) or ``evaluate/report.json`` (``pipeline`` jobs). This
collects them into ``sweep.csv`` and ``sweep.md`` (one row per job, the swept
values first), ``sweep_drafters.csv`` (one row per drafter of every job's report, the second
table of ``sweep.md``) and, for each swept key, ``sweep_<key>.png`` with speedup and
acceptance against its values. Jobs without a report are listed as unfinished.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from distill.config import Config
from distill.drafters.build import describe_layers
from distill.errors import DraftsmithError
from distill.files import write_text_atomic
from distill.measure.timing_trust import disturbed, speed_verdict_word
from distill.runs import REUSED, StageRun, is_complete, read_manifest

FIGURES = (  # (column, path in report.json)
    # exact, on every held-out prompt (decode.acceptance); the timed figures below cover evaluate.timed_prompts
    ("simulated_tau", ("simulated", "mean_accepted_tokens")),
    ("simulated_acceptance", ("simulated", "acceptance_rate")),
    ("simulated_prompts", ("simulated", "num_prompts")),
    ("baseline_simulated_tau", ("baseline_drafter", "simulated", "mean_accepted_tokens")),
    ("tau_gain", ("paired_difference", "mean_accepted_tokens")),
    # the distilled drafter against the stock one (the base model as shipped), paired, each at its best K
    ("speedup_ratio_vs_stock", ("against_stock", "predicted_speedup_ratio", "ratio")),
    ("speedup_ratio_vs_stock_lo", ("against_stock", "predicted_speedup_ratio", "ci95", 0)),
    ("speedup_ratio_vs_stock_hi", ("against_stock", "predicted_speedup_ratio", "ci95", 1)),
    ("tau_vs_stock", ("against_stock", "tau_difference", "mean_accepted_tokens")),
    # true when other processes used the CPUs or the timing rounds disagreed: no speed verdict then
    ("timing_disturbed", ("timing", "disturbed")),
    ("timed_speedup_ratio_vs_stock", ("against_stock", "timed_speedup_ratio")),
    ("cost_ratio", ("cost_ratio",)),
    ("prompt_lookup_tau", ("baselines", "prompt_lookup", "simulated", "mean_accepted_tokens")),
    ("acceptance_rate", ("acceptance_rate",)),
    ("mean_accepted_tokens", ("mean_accepted_tokens",)),
    ("speculative_tokens_per_s", ("speculative_tokens_per_s",)),
    ("target_tokens_per_s", ("target_tokens_per_s",)),
    ("speedup", ("speedup",)),
    ("theoretical_speedup", ("theoretical_speedup",)),
    ("hf_assisted_speedup", ("baselines", "hf_assisted", "speedup")),
    ("baseline_acceptance_rate", ("baseline_drafter", "acceptance_rate")),
    ("baseline_speedup", ("baseline_drafter", "speedup")),
    ("outputs_match_target", ("outputs_match_target",)),
    # the training-time predictor (1 - TV on held-out answers), to set beside the measured acceptance
    ("val_expected_acceptance", ("distill_validation", "val_expected_acceptance_after")),
    # the greedy predictor: share of held-out positions where the drafter's argmax is the target's
    ("val_top1_agreement", ("distill_validation", "val_top1_agreement_after")),
    ("val_simulated_tau", ("distill_validation", "val_simulated_tau_after")),
    ("distill_s", ("stages", "distill", "wall_s")),
)
# a distill sweep's jobs have no report: their figures come from the distill manifest
DISTILL_FIGURES = (
    ("val_expected_acceptance", ("train", "val_expected_acceptance_after")),
    ("val_top1_agreement", ("train", "val_top1_agreement_after")),
    ("val_simulated_tau", ("train", "val_simulated_tau_after")),
    ("distill_s", ("wall_s",)),
)
ERROR_FILE = "error.txt"  # a sweep job's error, written by the CLI (distill/cli.py)
_NOT_SWEPT = ("stage", "outputs")


def _dig(obj: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        if isinstance(key, int):
            obj = obj[key] if isinstance(obj, list) and -len(obj) <= key < len(obj) else None
        elif isinstance(obj, dict):
            obj = obj.get(key)
        else:
            return None
    return obj


def _value(text: str) -> Any:
    """An override value as YAML reads it (numbers compare and sort as numbers; YAML 1.1 reads ``1e-4``,
    without a dot, as text, Hydra as a float)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def find_sweep(outputs: str | Path) -> Path:
    """The newest sweep folder under ``outputs/multirun`` (the one holding job folders).

    Raises:
        DraftsmithError: there is none.
    """
    jobs = [p.parent.parent for p in Path(outputs, "multirun").glob("*/*/*/.hydra/overrides.yaml")]
    if not jobs:
        raise DraftsmithError(f"no sweep under {Path(outputs, 'multirun')}: run one with `draftsmith pipeline -m "
                              f"key=a,b` or give inputs.sweep=<folder>")
    return max({job.parent for job in jobs}, key=lambda p: p.stat().st_mtime)


def collect(sweep: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows (overrides + figures + status) of every job in ``sweep``, and the keys whose values vary.

    Raises:
        DraftsmithError: ``sweep`` holds no job folder.
    """
    if not Path(sweep).is_dir():
        raise DraftsmithError(f"sweep folder {sweep} does not exist: give inputs.sweep=<the folder that "
                              f"`draftsmith <stage> -m ...` printed>, or none for the newest sweep")
    rows = []
    for overrides_file in sorted(Path(sweep).glob("*/.hydra/overrides.yaml")):
        job = overrides_file.parent.parent
        overrides = {}
        for item in yaml.safe_load(overrides_file.read_text()) or []:
            key, _, value = str(item).lstrip("+~").partition("=")
            if key not in _NOT_SWEPT:
                overrides[key] = _value(value)
        report_path = next((p for p in (job / "report.json", job / "evaluate" / "report.json") if p.is_file()), None)
        row: dict[str, Any] = {"job": job.name, **overrides}
        distill_run = job  # a distill job, or the finished run it found (reused.json)
        if (job / REUSED).is_file():
            distill_run = Path(json.loads((job / REUSED).read_text()).get("distill_run", job))
        if report_path is not None:
            report = json.loads(report_path.read_text())
            row["status"] = "finished"
            row.update({name: _dig(report, path) for name, path in FIGURES})
            row["drafter"] = describe_drafter(report.get("drafter") or {})
        elif is_complete(distill_run) and read_manifest(distill_run).get("stage") == "distill":
            manifest = read_manifest(distill_run)
            row["status"] = "finished" if distill_run == job else "finished (reused)"
            row.update({name: _dig(manifest, path) for name, path in DISTILL_FIGURES})
            row["drafter"] = describe_drafter(manifest.get("drafter") or {})
        elif (job / ERROR_FILE).is_file():
            why = (job / ERROR_FILE).read_text().strip().splitlines()[0]
            row["status"] = "failed: " + why.removeprefix("error: ")[:200]
        else:
            row["status"] = "unfinished"
        rows.append(row)
    if not rows:
        raise DraftsmithError(f"{sweep} holds no sweep job (no */.hydra/overrides.yaml): give the folder that "
                              f"`draftsmith <stage> -m ...` printed, e.g. outputs/multirun/pipeline/<time>")
    keys = sorted({k for r in rows for k in r} - {"job", "status", "drafter"} - {name for name, _ in FIGURES})
    swept = [k for k in keys if len({json.dumps(r.get(k), sort_keys=True) for r in rows}) > 1]
    return rows, swept


DRAFTER_COLUMNS = ("job", "drafter", "prompts", "acceptance", "acceptance_lo", "acceptance_hi", "tau", "tau_lo",
                   "tau_hi", "top1_agreement", "best_k", "cost_ratio", "predicted_speedup", "predicted_speedup_lo",
                   "predicted_speedup_hi", "ratio_vs_stock", "ratio_vs_stock_lo", "ratio_vs_stock_hi",
                   "verdict_vs_stock", "timing", "timed_speedup")


def drafter_rows(sweep: Path) -> list[dict[str, Any]]:
    """One row per drafter of every finished job's report (the distilled one, the undistilled one, the
    ``compare_drafters``, prompt lookup): its simulated figures with intervals, its best K, c, the predicted
    speedup there and the ratio to the stock drafter's (paired interval); the columns of ``DRAFTER_COLUMNS``."""
    rows = []
    for overrides_file in sorted(Path(sweep).glob("*/.hydra/overrides.yaml")):
        job = overrides_file.parent.parent
        report_path = next((p for p in (job / "report.json", job / "evaluate" / "report.json") if p.is_file()), None)
        if report_path is None:
            continue
        report = json.loads(report_path.read_text())
        lookup = (report.get("baselines") or {}).get("prompt_lookup") or {}
        sections = [("distilled: " + describe_drafter(report.get("drafter") or {}), report),
                    ("undistilled", report.get("baseline_drafter") or {}),
                    *((str(name), other) for name, other in (report.get("compared_drafters") or {}).items()),
                    ("prompt lookup (drafting free)", lookup)]
        rows += [_drafter_row(job.name, label, section, report) for label, section in sections
                 if section.get("simulated")]
    return rows


def _drafter_row(job: str, label: str, section: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """One drafter's row of :data:`DRAFTER_COLUMNS` from its ``section`` of ``report``; ``verdict_vs_stock``
    follows :func:`distill.measure.timing_trust.speed_verdict` (none where the job's timing was disturbed)."""
    sim = section["simulated"]
    best = sim.get("recommended_draft_length")
    ratio = (section.get("against_stock") or {}).get("predicted_speedup_ratio") or {}
    row = {"job": job, "drafter": label, "prompts": sim.get("num_prompts"), "acceptance": sim.get("acceptance_rate"),
           "tau": sim.get("mean_accepted_tokens"), "top1_agreement": sim.get("top1_agreement"), "best_k": best,
           "cost_ratio": sim.get("cost_ratio", section.get("cost_ratio")),  # side by side, timed or not
           "predicted_speedup": ((sim.get("per_k") or {}).get(str(best)) or {}).get("predicted_speedup"),
           "ratio_vs_stock": ratio.get("ratio"), "timed_speedup": section.get("speedup"),
           "verdict_vs_stock": speed_verdict_word(ratio, report) if ratio.get("ci95") else None,
           "timing": "disturbed" if disturbed(report) else "quiet"}
    for name, interval in (("acceptance", _dig(sim, ("ci95", "acceptance_rate"))),
                           ("tau", _dig(sim, ("ci95", "mean_accepted_tokens"))),
                           ("predicted_speedup", _dig(sim, ("ci95", "predicted_speedup_at_best_k"))),
                           ("ratio_vs_stock", ratio.get("ci95"))):
        row[f"{name}_lo"], row[f"{name}_hi"] = interval or (None, None)
    return row


def render_drafters(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """:func:`drafter_rows` as (CSV text, Markdown table); empty strings without rows."""
    if not rows:
        return "", ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=DRAFTER_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)

    def interval(row, key, fmt):
        value, lo, hi = row.get(key), row.get(f"{key}_lo"), row.get(f"{key}_hi")
        if value is None:
            return "-"
        return fmt.format(value) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]" if lo is not None else "")

    lines = ["## Every drafter, side by side within its job", "",
             "Simulated exactly on the job's held-out prompts (95% bootstrap intervals over prompts); the predicted "
             "speedup is at each drafter's best K with its measured c; the ratio to the stock drafter is paired on "
             "the same prompts (newer reports resample the timing rounds too); its verdict is given only where the "
             "interval excludes 1 and the job's timing was quiet (`timing`: disturbed when other processes used the "
             "CPUs or the timing rounds disagreed); timed speedup: the decoder on the timed prompts, at the run's K.",
             "", "| job | drafter | prompts | acceptance | tau | top-1 agreement | best K | c | predicted speedup | "
             "ratio to stock | verdict | timing | timed speedup |", "|---" * 13 + "|"]
    lines += [f"| {r['job']} | {r['drafter']} | {_fmt(r['prompts'])} | {interval(r, 'acceptance', '{:.3f}')} | "
              f"{interval(r, 'tau', '{:.2f}')} | {_fmt(r['top1_agreement'])} | {_fmt(r['best_k'])} | "
              f"{_fmt(r['cost_ratio'])} | {interval(r, 'predicted_speedup', '{:.2f}')} | "
              f"{interval(r, 'ratio_vs_stock', '{:.3f}')} | {_fmt(r['verdict_vs_stock'])} | {r['timing']} | "
              f"{_fmt(r['timed_speedup'])} |" for r in rows]
    return buffer.getvalue(), "\n".join(lines) + "\n"


def planned_jobs(sweep: Path) -> int | None:
    """How many jobs the sweep's command asked for (the product of its comma-separated values, from
    ``multirun.yaml``), or None when that cannot be told (a range sweep, no file)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        task = (yaml.safe_load((Path(sweep) / "multirun.yaml").read_text()) or {})["hydra"]["overrides"]["task"]
        planned = 1
        for override in OverridesParser.create().parse_overrides([str(t) for t in task or []]):
            if override.is_sweep_override():
                if not override.is_discrete_sweep():
                    return None
                planned *= len(list(override.sweep_string_iterator()))
        return planned
    except Exception:  # noqa: BLE001 (an old or hand-made sweep folder: say nothing rather than fail)
        return None


def describe_drafter(info: dict[str, Any]) -> str:
    """A short label of how a drafter was made, from its ``drafter_info.json``, e.g.
    ``"4 layers, full, fkl, stored, on-policy 0.5"`` (what tells drafters apart in a sweep over
    ``inputs.distill``)."""
    parts = [describe_layers(info["num_layers"], info.get("layer_selection") or "first", info.get("layers"))
             if info.get("init") == "layers" else str(info.get("base_name") or "")]
    parts += [str(info[k]) for k in ("method", "loss") if info.get(k)]
    if info.get("target_source") == "stored":
        parts.append("stored")
    if info.get("on_policy_fraction"):
        parts.append(f"on-policy {info['on_policy_fraction']:g}")
    if info.get("draft_vocab_size"):
        parts.append(f"vocab {info['draft_vocab_size']}")
    return ", ".join(p for p in parts if p)


def _columns(rows: list[dict[str, Any]], swept: list[str]) -> list[str]:
    fixed = sorted({k for r in rows for k in r} - set(swept) - {"job", "status", "drafter"} - {n for n, _ in FIGURES})
    return ["job", *swept, "drafter", "status", *(name for name, _ in FIGURES), *fixed]


def _fmt(value: Any) -> str:
    if isinstance(value, float):  # swept learning rates (1e-4) and huge values keep their digits
        return f"{value:.3g}" if value and not 0.01 <= abs(value) < 1e5 else f"{value:.3f}"
    return "-" if value is None else str(value)


def render(rows: list[dict[str, Any]], swept: list[str], sweep: Path) -> tuple[str, str]:
    """The sweep as (CSV text, Markdown text)."""
    columns = _columns(rows, swept)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    shown = ["job", *swept, "drafter", "status", "simulated_tau", "tau_gain", "speedup_ratio_vs_stock",
             "timing_disturbed", "acceptance_rate", "mean_accepted_tokens", "speedup",
             "baseline_simulated_tau", "val_expected_acceptance", "val_top1_agreement", "distill_s", "outputs_match_target"]
    planned = planned_jobs(sweep)
    missing = (f" {planned - len(rows)} of the {planned} planned jobs never started: Hydra stops a sweep at its "
               f"first failed job; fix it and run the same sweep again (finished distill runs are reused)."
               if planned and planned > len(rows) else "")
    lines = [f"# Sweep {sweep}", "", f"{len(rows)} jobs; swept: {', '.join(swept) or 'nothing varies'}.{missing}", "",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in shown) + " |" for r in rows]
    return buffer.getvalue(), "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], swept: list[str], folder: Path) -> list[Path]:
    """``sweep_<key>.png`` per swept key: speedup and acceptance rate against its values, a line per
    combination of the other swept values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)  # "Using categorical units..." per call
    done = [r for r in rows if r["status"].startswith("finished")]
    if any(r.get("simulated_tau") is not None for r in done):
        shown = (("simulated_tau", "tau, every held-out prompt (simulated)"), ("speedup", "speedup (timed prompts)"))
    elif any(r.get("speedup") is not None for r in done):
        shown = (("speedup", "speedup vs target alone"), ("acceptance_rate", "acceptance rate"))
    else:  # a distill sweep: the held-out predictors of acceptance
        shown = (("val_top1_agreement", "held-out top-1 agreement"),
                 ("val_expected_acceptance", "held-out 1 - TV (expected acceptance)"))
    written = []
    for key in swept:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        groups: dict[str, list[dict]] = {}
        for r in done:
            label = ", ".join(f"{k}={r.get(k)}" for k in swept if k != key) or "all jobs"
            groups.setdefault(label, []).append(r)
        for label, members in groups.items():
            members.sort(key=lambda r: (str(type(r.get(key))), r.get(key)))
            # long values (run folders swept as inputs.distill) are told apart by their drafter instead
            xs = [str(r.get(key)) if len(str(r.get(key))) <= 24 else r.get("drafter") or r["job"] for r in members]
            numeric = all(isinstance(r.get(key), (int, float)) for r in members)  # a line only between numbers
            for ax, (figure, _) in zip(axes, shown):
                ax.plot(xs, [r.get(figure) or 0.0 for r in members], marker="o", linestyle="-" if numeric else "",
                        label=label)
        if any(len(str(x)) > 8 for ax in axes for line in ax.get_lines() for x in line.get_xdata()):
            for ax in axes:
                ax.tick_params(axis="x", labelrotation=30, labelsize=7)
                plt.setp(ax.get_xticklabels(), ha="right")
        axes[0].set(xlabel=key, ylabel=shown[0][1])
        axes[0].set_ylim(bottom=0)  # from 0: run-to-run noise does not look like a trend
        axes[1].set(xlabel=key, ylabel=shown[1][1], ylim=(0, 1))
        if len(groups) > 1:
            axes[1].legend(fontsize=7)
        fig.tight_layout()
        written.append(folder / f"sweep_{key.replace('/', '_')}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def run_gather(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Gather ``inputs.sweep`` (default: the newest sweep) into ``run_dir``; returns the path of ``sweep.md``.

    Raises:
        DraftsmithError: no sweep, or a folder that is not one.
    """
    sweep = Path(cfg.inputs.sweep) if cfg.inputs.sweep else find_sweep(cfg.outputs)
    rows, swept = collect(sweep)
    run = StageRun.start("gather", run_dir, config_yaml, inputs={"sweep": str(sweep)})
    csv_text, markdown = render(rows, swept, sweep)
    write_text_atomic(run_dir / "sweep.csv", csv_text)
    drafters_csv, drafters_md = render_drafters(drafter_rows(sweep))
    if drafters_csv:
        write_text_atomic(run_dir / "sweep_drafters.csv", drafters_csv)
        markdown += "\n" + drafters_md
    plots = plot(rows, swept, run_dir)
    markdown += "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    write_text_atomic(run_dir / "sweep.md", markdown)
    print(markdown)
    run.complete(sweep=str(sweep), jobs=len(rows), swept=swept,
                 unfinished=sum(not r["status"].startswith("finished") for r in rows), planned=planned_jobs(sweep))
    return run_dir / "sweep.md"
