"""Resuming a killed distill run by running the same command again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.errors import ConfigError
from distill.runs import COMPLETE
from distill.stages.distill import run_distill
from distill.training.checkpoint import STATE_FILE
from distill.training.resume import (
    RESUME_KEY,
    find_resumable,
    hold_lock,
    latest_checkpoint,
    named_checkpoint,
    prepare_resume,
    resume_key,
)
from tests.distill.test_config import _compose
from tests.distill.stages.test_pipeline import REPO, TINY_THREADS, draftsmith_tiny


def _fake_run(root: Path, name: str, key: str, steps=(5, 10), complete=False) -> Path:
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    for step in steps:
        (run / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"checkpoint-{step}" / STATE_FILE).write_text("{}")
    (run / RESUME_KEY).write_text(json.dumps({"key": key}))
    if complete:
        (run / COMPLETE).write_text("")
    return run


def test_resume_key_ignores_only_the_length_of_training():
    base = _compose("experiment=tiny")
    key = resume_key(base, "data-a", "fp")
    assert key == resume_key(_compose("experiment=tiny", "distill.max_steps=99", "distill.checkpoint_every=3"),
                             "data-a", "fp")
    assert key != resume_key(_compose("experiment=tiny", "distill.lr=0.000123"), "data-a", "fp")
    assert key != resume_key(base, "data-b", "fp")
    assert key != resume_key(base, "data-a", "other-target")


def test_resume_key_holds_what_auto_mixed_precision_becomes_here(monkeypatch):
    import distill.hardware
    import distill.models.loading

    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: False)
    auto = resume_key(_compose("experiment=tiny"), "data-a", "fp")
    assert auto == resume_key(_compose("experiment=tiny", "distill.mixed_precision=no"), "data-a", "fp")
    assert auto != resume_key(_compose("experiment=tiny", "distill.mixed_precision=bf16"), "data-a", "fp")
    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: True)  # a machine with bf16 units
    assert resume_key(_compose("experiment=tiny"), "data-a", "fp") != auto


def test_resume_key_leaves_out_settings_that_others_make_moot():
    # experiment=tiny trains with loss=fkl and method=full: jsd_beta and the LoRA settings change nothing
    base = _compose("experiment=tiny")
    assert (base.distill.loss, base.distill.method) == ("fkl", "full")
    key = resume_key(base, "data-a", "fp")
    moot = _compose("experiment=tiny", "distill.jsd_beta=0.9", "distill.lora_r=4", "distill.on_policy_temperature=0.5")
    assert resume_key(moot, "data-a", "fp") == key
    # ... and count once they apply
    jsd = resume_key(_compose("experiment=tiny", "distill.loss=jsd"), "data-a", "fp")
    assert jsd != key
    assert resume_key(_compose("experiment=tiny", "distill.loss=jsd", "distill.jsd_beta=0.9"), "data-a", "fp") != jsd
    assert resume_key(_compose("experiment=tiny", "distill.freeze_embeddings=false"), "data-a", "fp") != key


def test_find_resumable_picks_the_newest_unfinished_run_with_the_key(tmp_path):
    _fake_run(tmp_path, "a", "k1")
    time.sleep(0.01)
    newest = _fake_run(tmp_path, "pipeline/b/distill", "k1", steps=(5, 15))
    _fake_run(tmp_path, "c", "k1", complete=True)
    _fake_run(tmp_path, "d", "k2")
    _fake_run(tmp_path, "e", "k1", steps=())
    run, checkpoint = find_resumable(tmp_path, "k1", exclude=tmp_path / "new")
    assert run == newest and checkpoint.name == "checkpoint-15"
    assert find_resumable(tmp_path, "k3", exclude=tmp_path / "new") is None
    lock = hold_lock(newest)  # a live run is never taken over
    try:
        assert find_resumable(tmp_path, "k1", exclude=tmp_path / "new")[0] == tmp_path / "a"
    finally:
        lock.close()


def test_a_named_run_folder_lends_its_curves_and_stays_intact(tmp_path):
    old = _fake_run(tmp_path, "old", "k1", steps=(5, 10), complete=True)
    for name in ("metrics.jsonl", "validation.jsonl"):
        (old / "checkpoints" / name).write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n"
                                                        for s in (1, 5, 10, 12)))
    (old / "log.jsonl").write_text(json.dumps({"step": 10, "loss": 0.1}) + "\n" + json.dumps({"summary": 1}) + "\n")
    new = tmp_path / "new"
    new.mkdir()
    cfg = _compose("experiment=tiny", f"distill.resume={old}", f"outputs={tmp_path}")
    checkpoint, facts = prepare_resume(cfg, new, "k1")
    assert checkpoint == old / "checkpoints" / "checkpoint-10" and facts["resumed_from"] == str(checkpoint)
    for name in ("metrics.jsonl", "validation.jsonl"):  # copied whole; training keeps the steps <= 10
        assert (new / "checkpoints" / name).read_text() == (old / "checkpoints" / name).read_text()
    assert [json.loads(line) for line in (new / "log.jsonl").read_text().splitlines()] == [{"step": 10, "loss": 0.1}]
    assert (old / COMPLETE).exists() and (old / "checkpoints" / "checkpoint-10" / STATE_FILE).exists()


def test_latest_checkpoint_needs_the_state_file(tmp_path):
    _fake_run(tmp_path, "r", "k", steps=(5, 20))
    (tmp_path / "r" / "checkpoints" / "checkpoint-30").mkdir()  # half-written: no state file
    assert latest_checkpoint(tmp_path / "r" / "checkpoints").name == "checkpoint-20"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_a_named_resume_folder_without_a_checkpoint_is_refused_before_any_work(tmp_path):
    run = _fake_run(tmp_path, "r", "k", steps=(5, 20))
    assert named_checkpoint(str(run)).name == "checkpoint-20"
    assert named_checkpoint(str(run / "checkpoints" / "checkpoint-5")).name == "checkpoint-5"
    assert named_checkpoint("auto") is None and named_checkpoint("never") is None
    with pytest.raises(ConfigError, match="distill.resume=auto continues"):
        named_checkpoint("true")
    # run_distill refuses it before it reads data or loads a model: no run folder is made
    cfg = _compose("experiment=tiny", f"distill.resume={tmp_path / 'missing'}", f"outputs={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match="not a checkpoint-<step> folder"):
        run_distill(cfg, tmp_path / "out" / "distill" / "x")
    assert not (tmp_path / "out").exists()


def _losses(run: Path) -> list[float]:
    lines = (run / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


@pytest.mark.slow
def test_killed_distill_resumes_with_the_same_command(tmp_path):
    """SIGTERM a real distill process after a checkpoint; the same command finishes the run with the
    loss curve of an uninterrupted one."""
    out = tmp_path / "outputs"
    proc = draftsmith_tiny("generate", "experiment=tiny", f"outputs={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gen = next(out.glob("generate/*"))
    args = ["distill", "experiment=tiny", f"inputs.generate={gen}", "distill.max_steps=60",
            "distill.checkpoint_every=10", "distill.val_fraction=0.25", "logger=jsonl"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **TINY_THREADS}
    killed = subprocess.Popen([sys.executable, "-m", "distill.cli", *args, f"outputs={out}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list(out.glob("distill/*/checkpoints/checkpoint-20/" + STATE_FILE)):
        time.sleep(0.05)
    killed.send_signal(signal.SIGTERM)  # a scheduler's stop: one line that says how to go on, no traceback
    _, stderr = killed.communicate()
    assert killed.returncode == 143 and "Traceback" not in stderr, stderr[-2000:]
    assert "draftsmith distill: stopped (SIGTERM); the same command again resumes" in stderr
    [dead] = list(out.glob("distill/*"))
    assert not (dead / COMPLETE).exists() and latest_checkpoint(dead / "checkpoints") is not None

    resumed = draftsmith_tiny(*args, f"outputs={out}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout
    [new] = list(out.glob("distill/*"))  # the dead run's folder moved into the new one
    assert new != dead and not dead.exists()
    assert (new / "attempts" / dead.name / "config.yaml").is_file()
    assert not (new / "attempts" / dead.name / "checkpoints").exists()
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["resumed_run"] == str(new / "attempts" / dead.name)
    step = int(Path(manifest["resumed_from"]).name.split("-")[1])
    assert 20 <= step < 60
    # one log for the whole run: the killed run's steps up to the checkpoint, then the rest
    logged = [json.loads(line) for line in (new / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 61))
    assert [r["step"] for r in logged if "val_loss" in r] == [0, 60]  # before (from the killed run) and after

    fresh = draftsmith_tiny(*args, "distill.resume=never", f"outputs={tmp_path / 'fresh'}", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    [uninterrupted] = list((tmp_path / "fresh").glob("distill/*"))
    assert _losses(new) == pytest.approx(_losses(uninterrupted), rel=1e-4, abs=1e-6)
    assert len(_losses(new)) == 60
    # "before" is the untrained drafter's validation, carried by the checkpoint, not the resume point's
    before = {k: v for k, v in manifest["train"].items() if k.endswith("_before")}
    fresh_manifest = json.loads((uninterrupted / "manifest.json").read_text())
    assert before and before == pytest.approx({k: fresh_manifest["train"][k] for k in before}, rel=1e-6)


@pytest.mark.slow
def test_killed_generate_resumes_to_the_same_dataset(tmp_path):
    """SIGKILL a real generate process after its first shards; the same command finishes with the dataset an
    uninterrupted run writes."""
    from datasets import load_from_disk

    out = tmp_path / "outputs"
    args = ["generate", "experiment=tiny", "generate.num_prompts=120", "generate.shard_size=4",
            "generate.batch_size=4", "logger=none"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **TINY_THREADS}
    killed = subprocess.Popen([sys.executable, "-m", "distill.cli", *args, f"outputs={out}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob(".shards/*/shard-*"))) < 3:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    done = len(list(out.glob(".shards/*/shard-*")))
    assert 3 <= done < 30, "the kill should land mid-run"

    resumed = draftsmith_tiny(*args, f"outputs={out}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout
    fresh = draftsmith_tiny(*args, f"outputs={tmp_path / 'fresh'}", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]

    def rows(root):
        [run] = [p for p in root.glob("generate/*") if (p / COMPLETE).exists()]
        data = load_from_disk(str(run / "dataset"))
        return list(zip(data["prompt_id"], data["completion_ids"]))

    assert rows(out) == rows(tmp_path / "fresh") and len(rows(out)) == 120


def test_disk_full_names_the_path_and_sizes(tmp_path, monkeypatch):
    import errno

    from distill.errors import DiskFullError
    from distill.files import atomic_dir, require_free_space, write_text_atomic

    with pytest.raises(DiskFullError, match=r"not enough disk space for drafter at .* GiB needed, .* GiB free"):
        require_free_space(tmp_path / "new" / "sub", 10**18, "drafter")
    from distill.files import human_bytes  # sizes in a unit that fits: never "0.00 GiB needed"

    assert [human_bytes(n) for n in (512, 3 * 2**10, 5 * 2**20, 2**31)] == ["512 bytes", "3.0 KiB", "5.0 MiB",
                                                                           "2.00 GiB"]
    with pytest.raises(DiskFullError, match="drafter"):
        with atomic_dir(tmp_path / "drafter", needed_bytes=10**18):
            pass
    with pytest.raises(DiskFullError, match=r"disk filled up while writing .*out.*partial output was removed"):
        with atomic_dir(tmp_path / "out", needed_bytes=1000) as tmp:
            (tmp / "half").write_text("x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("distill.files.os.replace", full)
    with pytest.raises(DiskFullError, match="report.json"):
        write_text_atomic(tmp_path / "report.json", "{}")
    assert not list(tmp_path.glob(".report.json.*"))


def test_atomic_dir_replaces_a_folder_only_once_the_new_one_is_whole(tmp_path, monkeypatch):
    """export.overwrite: the earlier export stays as it was on any failure, and nothing is left beside it."""
    from distill.files import atomic_dir

    final = tmp_path / "drafter"
    final.mkdir()
    (final / "config.json").write_text("old")
    with pytest.raises(FileExistsError):
        with atomic_dir(final):
            pass
    with pytest.raises(ValueError):
        with atomic_dir(final, replace=True) as tmp:
            (tmp / "config.json").write_text("half")
            raise ValueError("the reload check failed")
    assert (final / "config.json").read_text() == "old" and sorted(tmp_path.iterdir()) == [final]
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (final / "config.json").read_text() == "new" and sorted(tmp_path.iterdir()) == [final]


def test_atomic_writes_leave_the_modes_a_plain_write_would(tmp_path):
    """mkdtemp/mkstemp make 0700/0600 and safetensors writes 0600: an export must still be readable by others."""
    from distill.files import atomic_dir, write_text_atomic

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "drafter") as tmp:
            (tmp / "sub").mkdir()
            for name in ("model.safetensors", "sub/x.json"):
                (tmp / name).write_text("x")
                (tmp / name).chmod(0o600)
        write_text_atomic(tmp_path / "report.json", "{}")
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "drafter") == 0o755 and mode(tmp_path / "drafter" / "sub") == 0o755
    assert mode(tmp_path / "drafter" / "model.safetensors") == 0o644
    assert mode(tmp_path / "drafter" / "sub" / "x.json") == 0o644 and mode(tmp_path / "report.json") == 0o644


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, caplog):
    import torch
    from safetensors.torch import save_file

    run = _fake_run(tmp_path, "a", "k1", steps=(5, 10))
    for step in (5, 10):
        folder = run / "checkpoints" / f"checkpoint-{step}"
        save_file({"w": torch.ones(64, 64)}, str(folder / "model.safetensors"))
        torch.save({"state": {}}, folder / "optimizer.pt")
    assert latest_checkpoint(run / "checkpoints").name == "checkpoint-10"
    newest = run / "checkpoints" / "checkpoint-10" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated: a power cut, a full disk outside our writes
    assert latest_checkpoint(run / "checkpoints").name == "checkpoint-5"
    assert "checkpoint-10 cannot be read (model.safetensors" in caplog.text
    optimizer = run / "checkpoints" / "checkpoint-5" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:20])
    assert latest_checkpoint(run / "checkpoints") is None


def test_a_damaged_checkpoint_named_by_distill_resume_is_refused_with_its_file(tmp_path):
    """Issue 37 case 9: automatic resume skips a damaged checkpoint, but one the user names is never swapped for
    another; a cut optimizer.pt gave a PytorchStreamReader traceback after the models had loaded."""
    import torch

    run = _fake_run(tmp_path, "a", "k1", steps=(5, 10))
    for step in (5, 10):
        torch.save({"state": {}}, run / "checkpoints" / f"checkpoint-{step}" / "optimizer.pt")
    optimizer = run / "checkpoints" / "checkpoint-10" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:20])
    named = run / "checkpoints" / "checkpoint-10"
    with pytest.raises(ConfigError, match=r"distill.resume=.*checkpoint-10: the checkpoint cannot be read "
                                          r"\(optimizer.pt: BadZipFile.*name an earlier one "
                                          r"\(distill.resume=.*checkpoint-5\)"):
        named_checkpoint(str(named))
    assert named_checkpoint(str(run)).name == "checkpoint-5"  # a run folder named: its newest readable one
    # refused before any data or model loads: no run folder is made
    cfg = _compose("experiment=tiny", f"distill.resume={named}", f"outputs={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match="optimizer.pt"):
        run_distill(cfg, tmp_path / "out" / "distill" / "x")
    assert not (tmp_path / "out").exists()


@pytest.mark.extra
def test_two_generate_runs_into_one_outputs_take_turns_and_agree(tmp_path):
    """A sweep or a retry can start the same generate twice at once: the second waits for the shard cache's
    lock and reuses the shards instead of dying on a rename of a folder the first wrote."""
    from datasets import load_from_disk

    out = tmp_path / "outputs"
    args = ["generate", "experiment=tiny", "generate.num_prompts=40", "generate.shard_size=4", "logger=none",
            f"outputs={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **TINY_THREADS}
    procs = [subprocess.Popen([sys.executable, "-m", "distill.cli", *args, f"hydra.run.dir={out}/generate/run{i}"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    stdout = "".join(o for o, _ in results)
    assert "another run is writing shards" in stdout or "resuming" in stdout
    rows = [load_from_disk(str(out / "generate" / f"run{i}" / "dataset")) for i in range(2)]
    assert rows[0]["completion_ids"] == rows[1]["completion_ids"] and len(rows[0]) == 40


def test_a_folder_written_twice_at_once_gets_a_clear_error(tmp_path):
    from distill.errors import ConcurrentWriteError
    from distill.files import atomic_dir

    with pytest.raises(ConcurrentWriteError, match="another process.*run the same command again"):
        with atomic_dir(tmp_path / "shard") as tmp:
            (tmp / "rows").write_text("mine")
            (tmp_path / "shard").mkdir()  # the other process renames its copy first
            (tmp_path / "shard" / "rows").write_text("theirs")
    assert (tmp_path / "shard" / "rows").read_text() == "theirs" and not list(tmp_path.glob(".shard.*"))


def test_each_process_resumes_with_its_own_rng_state_when_the_process_count_matches():
    from distill.training.checkpoint import rng_state_to_resume

    state = {"rng": {"torch": "main"}, "rng_per_process": [{"torch": "main"}, {"torch": "second"}]}
    assert rng_state_to_resume(state, 1, 2) == {"torch": "second"}
    assert rng_state_to_resume(state, 1, 3) == {"torch": "main"}  # another process count: the main's
    assert rng_state_to_resume({"rng": {"torch": "only"}}, 0, 1) == {"torch": "only"}  # a 1-process checkpoint


def test_resume_key_keeps_linear_schedule_runs_and_separates_constant_ones():
    base = _compose("experiment=tiny")
    key = resume_key(base, "data-a", "fp")
    assert key == resume_key(_compose("experiment=tiny", "distill.lr_schedule=linear", "distill.checkpoint_at=[1]"),
                             "data-a", "fp")
    assert key != resume_key(_compose("experiment=tiny", "distill.lr_schedule=constant"), "data-a", "fp")
