"""A two-point sweep on tiny models, gathered into one table and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from distill.errors import DraftsmithError
from distill.stages.gather import collect, find_sweep
from tests.distill.test_config import cli_in_process
from tests.distill.stages.test_pipeline import draftsmith, draftsmith_tiny


def test_two_point_sweep_gathered(tmp_path):
    out = tmp_path / "outputs"
    sweep = draftsmith_tiny("pipeline", "-m", "experiment=tiny", "decode.draft_length=2,3", "logger=none",
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
    # every drafter of every job, the stock one (tiny-target: the tiny drafter is cut from it) among them
    drafters = list(csv.DictReader((markdown.parent / "sweep_drafters.csv").open()))
    assert sorted({r["drafter"] for r in drafters}) == sorted(
        {"distilled: first 1 layer, full, fkl", "undistilled", "tiny-target", "prompt lookup (drafting free)"})
    assert len(drafters) == 8 and all(r["prompts"] == "3" for r in drafters)
    for r in drafters:
        if r["ratio_vs_stock"]:
            assert float(r["ratio_vs_stock_lo"]) <= float(r["ratio_vs_stock"]) <= float(r["ratio_vs_stock_hi"])
    assert sum(bool(r["ratio_vs_stock"]) for r in drafters) == 4  # distilled and undistilled, in both jobs
    # a verdict only from quiet timing (pytest's other worker may well have disturbed it)
    for r in drafters:
        assert r["timing"] in ("quiet", "disturbed")
        if r["ratio_vs_stock"]:
            assert r["verdict_vs_stock"] == "not judged" if r["timing"] == "disturbed" else \
                r["verdict_vs_stock"] in ("faster", "slower", "no difference shown")
    assert "| ratio to stock | verdict | timing |" in text
    assert "## Every drafter, side by side within its job" in text


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
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match="no sweep job"):
        collect(tmp_path / "empty")
    with pytest.raises(DraftsmithError, match="no sweep under"):
        find_sweep(tmp_path / "nothing")


def test_distill_jobs_reused_runs_failed_and_missing_jobs_are_told_apart(tmp_path):
    from distill.stages.gather import render

    sweep = tmp_path / "sweep"
    done = tmp_path / "distill" / "run"  # a finished distill run, found by the second job
    done.mkdir(parents=True)
    (done / "COMPLETE").write_text("")
    (done / "manifest.json").write_text(json.dumps({"stage": "distill", "wall_s": 12.5, "drafter": {"method": "full"},
                                                   "train": {"val_top1_agreement_after": 0.5}}))
    for name, lr in (("0_a", "1e-4"), ("1_b", "2e-4"), ("2_c", "1e12")):
        (sweep / name / ".hydra").mkdir(parents=True)
        (sweep / name / ".hydra" / "overrides.yaml").write_text(f"- stage=distill\n- distill.lr={lr}\n")
    for name in ("0_a", "1_b"):
        (sweep / name / "reused.json").write_text(json.dumps({"distill_run": str(done)}))
    (sweep / "2_c" / "error.txt").write_text("error: loss is nan at step 2\n")
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    task:\n    - stage=distill\n"
                                         "    - distill.lr=1e-4,2e-4,1e12,3e-4\n")
    rows, swept = collect(sweep)
    assert [r["status"] for r in rows] == ["finished (reused)", "finished (reused)", "failed: loss is nan at step 2"]
    assert rows[0]["val_top1_agreement"] == 0.5 and rows[0]["distill_s"] == 12.5 and rows[0]["drafter"]
    _, markdown = render(rows, swept, sweep)
    assert "1 of the 4 planned jobs never started" in markdown
    assert "| 0.0001 |" in markdown and "| 1e+12 |" in markdown  # swept values keep their digits
    with pytest.raises(DraftsmithError, match="does not exist"):
        collect(tmp_path / "nowhere")


def test_a_failed_sweep_job_records_its_error(tmp_path):
    for name in ("a", "b"):  # folders, but no runs: each job fails when it reads its folder
        (tmp_path / name).mkdir()
    # each job is refused before any model loads: the sweep runs in this process
    proc = cli_in_process("evaluate", "-m", "experiment=tiny", f"inputs.distill={tmp_path}/a,{tmp_path}/b",
                          f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode != 0
    rows, _ = collect(next((tmp_path / "out" / "multirun" / "evaluate").iterdir()))
    assert len(rows) == 1 and rows[0]["status"].startswith(f"failed: {tmp_path}/a is not a distill run folder")


@pytest.mark.extra
@pytest.mark.slow
def test_sweep_through_the_submitit_launcher_is_gathered(tmp_path):
    """The launcher path a SLURM sweep takes (hydra-submitit-launcher: each job pickled and run by submitit),
    with its local executor (conf/hydra/launcher/local.yaml) standing in for sbatch."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    out = tmp_path / "outputs"
    sweep = draftsmith_tiny("pipeline", "-m", "hydra/launcher=local", "experiment=tiny", "decode.draft_length=2,3",
                            "logger=none", f"outputs={out}", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    sweep_dir = next(out.glob("multirun/pipeline/*"))
    assert len(list(sweep_dir.glob("*/evaluate/COMPLETE"))) == 2
    assert list(sweep_dir.glob(".submitit/*/*_result.pkl")), "the jobs did not run through submitit"
    proc = draftsmith("gather", f"outputs={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((Path(proc.stdout.strip().splitlines()[-1]).parent / "sweep.csv").open()))
    assert sorted(r["decode.draft_length"] for r in rows) == ["2", "3"]
    assert all(r["status"] == "finished" and float(r["speedup"]) > 0 for r in rows)
