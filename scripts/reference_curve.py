"""Write ``distill/measure/reference_curve.json`` from an evaluate run that measured a budget curve.

    python scripts/reference_curve.py <evaluate run>/report.json --data "288 scored ShareGPT prompts ..." \
        --source "RESULTS.md, '<section>'"

The figures come from the report as measured (no value is typed by hand); the file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from distill.files import write_json_atomic  # noqa: E402
from distill.measure.standing import REFERENCE_CURVE, reference_from_report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="report.json of an evaluate run with evaluate.checkpoints=true")
    parser.add_argument("--data", required=True, help="what the drafter was trained on, in words")
    parser.add_argument("--source", required=True, help="where the curve is written up (RESULTS.md section)")
    parser.add_argument("--out", type=Path, default=REFERENCE_CURVE)
    args = parser.parse_args(argv)
    try:
        reference = reference_from_report(json.loads(args.report.read_text()), args.data, args.source)
    except (OSError, ValueError) as err:
        raise SystemExit(f"reference_curve: {err}")
    write_json_atomic(args.out, reference)
    print(f"reference_curve: {len(reference['points'])} points written to {args.out}")


if __name__ == "__main__":
    main()
