"""scripts/progress_gaps.py: a command run on a pseudo-terminal, its silences measured and judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "progress_gaps.py"


def _gaps(*args: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--json", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)


def _report(out: str) -> dict:
    return json.loads(out[out.index("{\n"):])


def test_a_silence_over_the_limit_is_named_with_what_was_shown_before_it():
    code = ("import time, tqdm\nprint('loading the target', flush=True)\ntime.sleep(1.5)\n"
            "for _ in tqdm.tqdm(range(2), desc='answers'): time.sleep(0.2)\n")
    run = _gaps("--limit", "1", "--top", "2", code=code)
    assert run.returncode == 1, run.stdout  # the 1.5 s silence is over the 1 s limit
    report = _report(run.stdout)
    first = report["gaps"][0]
    assert 1.4 <= first["seconds"] <= 3.0 and first["before"] == "loading the target"
    assert first["after"].startswith("answers:   0%")  # the bar draws on the pseudo-terminal
    assert report["over_limit"] == 1 and report["returncode"] == 0 and len(report["gaps"]) == 2


def test_within_the_limit_exits_0_and_a_failing_command_keeps_its_code():
    assert _gaps("--limit", "5", code="print('done')").returncode == 0
    failed = _gaps("--limit", "5", code="import sys; sys.exit(3)")
    assert failed.returncode == 3 and _report(failed.stdout)["returncode"] == 3
