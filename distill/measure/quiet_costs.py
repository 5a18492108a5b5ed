"""c measured on quiet runs of this host, kept so that a later run whose timing was disturbed has an honest
fallback: the same drafter's quiet c, or its c from shapes calibrated by the quiet runs of other drafters.

The record is one JSON file beside the model cache (``quiet_costs.json``): ``{host: {target signature:
{drafter signature: {"cost_ratio", "from_shapes", "ci95", "run", "when"}}}}``, keyed by what a forward's cost
depends on (the host's CPU or GPU and thread count, the models' modules and tensor shapes:
``decode.costs.signature_digest``), never by names or weights.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from distill.files import write_json_atomic
from distill.models.loading import default_cache_dir

QUIET_COSTS_FILE = "quiet_costs.json"


def quiet_costs_path() -> Path:
    """``quiet_costs.json`` beside the model cache (``$DRAFTSMITH_CACHE``'s parent, else ``~/.cache/draftsmith``)."""
    return default_cache_dir().parent / QUIET_COSTS_FILE


def host_key() -> str:
    """What a forward's time depends on besides the model: the CPU model (or GPU), cores and torch threads."""
    import torch

    if torch.cuda.is_available():
        return f"gpu:{torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu:{model}|{os.cpu_count()} cores|{torch.get_num_threads()} threads"


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: a fallback is a convenience, never a reason to stop
        return {}
    return record if isinstance(record, dict) else {}


def remember(costs: dict[str, Any], run: str, path: Path | None = None) -> None:
    """Add the quiet c of every drafter in ``costs`` (``decode.costs.measure_cost_ratios``' result) for this host
    to the record (atomically; an unwritable record is skipped with a printed line)."""
    path = path or quiet_costs_path()
    record = _read(path)
    pairs = record.setdefault(host_key(), {}).setdefault(costs["target_signature"], {})
    when = time.strftime("%Y-%m-%d %H:%M")
    for name, signature in costs["signatures"].items():
        pairs[signature] = {"cost_ratio": costs["cost_ratios"][name],
                            "from_shapes": costs["cost_ratio_from_shapes"][name],
                            "ci95": costs["cost_ratio_ci95"][name], "run": run, "when": when}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)
    except OSError as err:
        print(f"evaluate: could not record the quiet costs in {path} ({err}); nothing else depends on it")


def fallback_costs(costs: dict[str, Any], path: Path | None = None) -> dict[str, dict[str, Any]]:
    """For every drafter in ``costs``: ``{"cost_ratio": c, "source": words}`` from this host's record: the same
    drafter's quiet c where one was recorded, else its c from shapes times the median quiet c / c from shapes of
    the drafters recorded with the same target, else its c from shapes uncalibrated (labelled so)."""
    recorded = _read(path or quiet_costs_path()).get(host_key(), {}).get(costs["target_signature"], {})
    factors = [e["cost_ratio"] / e["from_shapes"] for e in recorded.values() if e.get("from_shapes")]
    factor = statistics.median(factors) if factors else None
    result = {}
    for name, signature in costs["signatures"].items():
        shapes = costs["cost_ratio_from_shapes"][name]
        if signature in recorded:
            entry = recorded[signature]
            result[name] = {"cost_ratio": entry["cost_ratio"],
                            "source": f"a quiet run on this host ({entry['when']})"}
        elif factor is not None:
            result[name] = {"cost_ratio": shapes * factor,
                            "source": f"shapes, calibrated by {len(factors)} quiet measurement(s) on this host"}
        else:
            result[name] = {"cost_ratio": shapes, "source": "shapes, uncalibrated (no quiet run on this host yet)"}
    return result
