"""A two-point sweep on tiny models, gathered into one table and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from distill.errors import DraftsmithError
from distill.gather import collect, find_sweep
from tests.test_pipeline import draftsmith


def test_two_point_sweep_gathered(tmp_path):
    out = tmp_path / "outputs"
    sweep = draftsmith("pipeline", "-m", "experiment=tiny", "decode.draft_length=2,3", "logger=none",
                       f"outputs={out}", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    jobs = list(out.glob("multirun/pipeline/*/*/evaluate/report.json"))
    assert len(jobs) == 2  # one folder level per job, whatever the override values hold
    proc = draftsmith("gather", f"outputs={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    markdown = Path(proc.stdout.strip().splitlines()[-1])
    assert markdown.name == "sweep.md"
    rows = list(csv.DictReader((markdown.parent / "sweep.csv").open()))
    assert sorted(r["decode.draft_length"] for r in rows) == ["2", "3"]
    assert all(r["status"] == "finished" and 0 <= float(r["acceptance_rate"]) <= 1 for r in rows)
    assert all(float(r["speedup"]) > 0 and r["outputs_match_target"] == "True" for r in rows)
    assert (markdown.parent / "sweep_decode.draft_length.png").is_file()
    text = markdown.read_text()
    assert "swept: decode.draft_length" in text and text.count("| finished |") == 2
    manifest = json.loads((markdown.parent / "manifest.json").read_text())
    assert manifest["swept"] == ["decode.draft_length"] and manifest["unfinished"] == 0


def test_unfinished_jobs_are_listed_and_bad_folders_refused(tmp_path):
    for name, overrides in (("0_a", ["distill.loss=fkl"]), ("1_b", ["distill.loss=jsd"])):
        hydra = tmp_path / "sweep" / name / ".hydra"
        hydra.mkdir(parents=True)
        (hydra / "overrides.yaml").write_text("".join(f"- {o}\n" for o in ["stage=pipeline", *overrides]))
    (tmp_path / "sweep" / "0_a" / "evaluate").mkdir()
    (tmp_path / "sweep" / "0_a" / "evaluate" / "report.json").write_text(json.dumps({"speedup": 1.5}))
    rows, swept = collect(tmp_path / "sweep")
    assert swept == ["distill.loss"]
    assert [r["status"] for r in rows] == ["finished", "unfinished"] and rows[0]["speedup"] == 1.5
    with pytest.raises(DraftsmithError, match="no sweep job"):
        collect(tmp_path / "empty")
    with pytest.raises(DraftsmithError, match="no sweep under"):
        find_sweep(tmp_path / "nothing")
