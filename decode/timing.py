"""Timing rounds as estimates: a robust centre, a bootstrap interval over rounds, and whether the machine
disturbed them.

A forward's time on a shared CPU is the model's own cost plus whatever other processes took; the second only
ever adds. Interleaved rounds (every model timed in each, so a slow spell falls on all of them) give one
sample of each cost per round; their median is the centre (robust while fewer than half of the rounds are
disturbed) and a bootstrap over rounds its interval. Two signs say the rounds cannot be trusted as they are:
other processes used the CPUs while they ran (:class:`CpuWatch`), or the rounds disagree more than a quiet
machine's do (:func:`relative_spread`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

NOISY_SPREAD = 0.15
"""Relative spread (interquartile range / median) of a cost's rounds above which they disagree more than
an idle host's do (the default pair on an idle 2-core AVX2 host: 0.06 for c and the target's forward, 0.08 for
the verification cost at 4 tokens; docs/decoding.md)."""

BUSY_SHARE = 0.25
"""Share of all CPUs other processes used during the timing above which the timing is called disturbed."""


def relative_spread(values: Sequence[float]) -> float:
    """(third quartile - first quartile) / median of ``values`` (rounds of one cost); 0.0 for fewer than 2.

    Raises:
        ValueError: a median of 0.
    """
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    if median == 0:
        raise ValueError("relative_spread of rounds whose median is 0")
    return (q3 - q1) / median


def median_ci(values: Sequence[float], *, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Percentile bootstrap interval ``[lo, hi]`` of the median of ``values`` (rounds) resampled with
    replacement (Efron and Tibshirani 1993, ch. 13); seeded, so a report repeats.

    Raises:
        ValueError: no values or a level outside (0, 1).
    """
    if not values or not 0 < level < 1:
        raise ValueError(f"median_ci needs values and a level in (0, 1), got {len(values)}, {level}")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return [medians[int((1 - level) / 2 * (resamples - 1))], medians[int(round((1 + level) / 2 * (resamples - 1)))]]


class CpuWatch:
    """The share of all CPUs (0-1) that other processes used while the ``with`` block ran: the machine's busy
    CPU time minus this process's own (all its threads), over wall time x CPUs. None without psutil.

    Example::

        with CpuWatch() as watch:
            ...  # timed work
        watch.others_share  # e.g. 0.02 on an idle host, 0.45 beside a CPU-bound job
    """

    def __init__(self) -> None:
        self.others_share: float | None = None
        self._start: tuple | None = None

    @staticmethod
    def _sample() -> tuple | None:
        try:
            import psutil
        except ImportError:
            return None
        system = psutil.cpu_times()
        busy = sum(system) - system.idle - getattr(system, "iowait", 0.0)
        own = psutil.Process().cpu_times()
        return time.perf_counter(), busy, own.user + own.system, psutil.cpu_count() or 1

    def __enter__(self) -> CpuWatch:
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        end = self._sample()
        if self._start is None or end is None:
            return
        wall = end[0] - self._start[0]
        if wall <= 0:
            return
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        self.others_share = round(min(1.0, max(0.0, others / (wall * end[3]))), 3)


def timing_check(rounds: dict[str, Sequence[float]], others_share: float | None) -> dict:
    """Whether timing rounds can be trusted: ``{"disturbed": bool, "reasons": [sentences], "others_cpu": share
    or None, "spread": {name: relative spread}}`` for ``rounds`` ({name: per-round values of one cost}) and the
    share of the CPUs other processes used meanwhile (:class:`CpuWatch`). Disturbed when that share exceeds
    :data:`BUSY_SHARE` or a cost's rounds spread wider than :data:`NOISY_SPREAD`."""
    spread = {name: round(relative_spread(values), 3) for name, values in rounds.items()}
    reasons = []
    if others_share is not None and others_share > BUSY_SHARE:
        reasons.append(f"other processes used {others_share:.0%} of the CPUs while the costs were timed")
    worst = max(spread, key=spread.get, default=None)
    if worst is not None and spread[worst] > NOISY_SPREAD:
        reasons.append(f"the timing rounds disagree (the {worst} rounds spread {spread[worst]:.0%} of their median, "
                       f"interquartile; an idle machine stays under {NOISY_SPREAD:.0%})")
    return {"disturbed": bool(reasons), "reasons": reasons, "others_cpu": others_share, "spread": spread}
