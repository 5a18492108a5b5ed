"""Whether a report's speed figures can be trusted, and the words a report, a model card and ``gather`` may use.

A speed verdict ("faster", "slower") rests on c and the verification costs, which are timings of this machine;
acceptance (tau) does not. The rule, the same everywhere: a verdict is stated only when the paired interval,
which resamples prompts and timing rounds together, excludes 1, and only when the timing was not disturbed
(other processes on the CPUs, or rounds that disagree beyond an idle machine's spread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decode.metrics import verify_cost_at
from decode.timing import BUSY_SHARE, timing_check


def report_timing(costs: dict[str, Any] | None, verify_rounds: Sequence[Sequence[float]] | None, draft_length: int,
                  busy_before: float | None, others_during: float | None) -> dict[str, Any]:
    """``report.json``'s ``timing``: ``{"disturbed": bool, "reasons": [sentences], "others_cpu": share of the
    CPUs other processes used during all of evaluate's timing, "busy_before": share just before it,
    "spread": {cost: relative spread of its rounds}}`` from the side-by-side c (``costs``, its ``timing``), the
    target's verification rounds at K + 1 tokens and the CPU watches.

    Raises:
        ValueError: what :func:`decode.timing.timing_check` raises.
    """
    side = (costs or {}).get("timing") or {}
    rounds = {f"verify cost at {draft_length + 1} tokens": [verify_cost_at(r, draft_length) for r in verify_rounds]
              } if verify_rounds else {}
    verify = timing_check(rounds, None)
    reasons = list(side.get("reasons") or []) + verify["reasons"]
    if busy_before is not None and busy_before > BUSY_SHARE:
        reasons.insert(0, f"other processes used {busy_before:.0%} of the CPUs when the timing started")
    if others_during is not None and others_during > BUSY_SHARE and not side.get("others_cpu", 0) > BUSY_SHARE:
        reasons.append(f"other processes used {others_during:.0%} of the CPUs over all of evaluate's timing")
    return {"disturbed": bool(reasons), "reasons": reasons, "others_cpu": others_during, "busy_before": busy_before,
            "spread": {**(side.get("spread") or {}), **verify["spread"]}}


def disturbed(report: dict[str, Any]) -> bool:
    """True when ``report``'s timing was disturbed (its ``timing``, or for older reports ``cpu_busy_before``)."""
    timing = report.get("timing")
    if timing is not None:
        return bool(timing.get("disturbed"))
    busy = report.get("cpu_busy_before")
    return busy is not None and busy > BUSY_SHARE


def disturbed_sentence(report: dict[str, Any]) -> str | None:
    """One sentence for the top of a report or card when the timing was disturbed; None when it was quiet."""
    if not disturbed(report):
        return None
    reasons = (report.get("timing") or {}).get("reasons") or [
        f"other processes used {report.get('cpu_busy_before', 0):.0%} of the CPUs when the timing started"]
    return ("**The timing was disturbed**: " + "; ".join(reasons) + ". Acceptance and tau are exact and "
            "unaffected; c, the speedups and their ratios are not judged here (their intervals resample the "
            "timing rounds but cannot undo a machine that was busy throughout). Re-run `draftsmith evaluate` on "
            "an idle machine to compare speeds.")


VERDICT_WORDS = ("faster", "slower", "no difference shown", "not judged")


def speed_verdict_word(ratio: dict[str, Any], report: dict[str, Any]) -> str:
    """One of :data:`VERDICT_WORDS` for a predicted-speedup ratio ``{"ratio", "ci95"}`` of two drafters:
    "faster" or "slower" only when its interval excludes 1 and ``report``'s timing was quiet."""
    lo, hi = ratio["ci95"]
    if disturbed(report):
        return "not judged"
    return "faster" if lo > 1 else "slower" if hi < 1 else "no difference shown"


def speed_verdict(ratio: dict[str, Any], report: dict[str, Any]) -> str:
    """:func:`speed_verdict_word` as a report's clause, e.g. "slower, the interval excludes no loss"."""
    return {"faster": "faster, the interval excludes no gain", "slower": "slower, the interval excludes no loss",
            "no difference shown": "no difference shown at this size",
            "not judged": "not judged: the timing was disturbed (see the top)"}[speed_verdict_word(ratio, report)]
