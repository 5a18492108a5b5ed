"""Data-parallel training: ``train_drafter`` on 2 CPU processes (DDP over gloo), the real
``draftsmith distill`` command under ``torchrun --nproc_per_node 2``, ``draftsmith generate`` sharing its
shards out over 2 and 3 processes, and ``draftsmith evaluate`` its teacher-forced passes over 2.

Two spawned processes each call :func:`distill.training.loop.train_drafter` on the same tiny random Qwen2
target and drafter (same seeds, so the same weights). A single-process run with twice the batch
size sees, step by step, the union of the two ranks' batches (the example stream is sharded by
whole batches: rank r gets batches r, r + 2, ...), so with gradients synchronised and the loss
weighted by the tokens of *all* processes, both runs must take the same steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from loop_settings import loop_settings
from spawned import free_port, spawn_and_collect

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
]

WORLD_SIZE = 2
BATCH = 2      # examples per process per micro-batch
STEPS = 3      # 3 steps x 2 processes x 2 examples = 12 > 8 examples: crosses an epoch boundary
SEED = 0
LR = 1e-2      # large, so a wrong gradient shows in the weights after a few steps
# completion lengths (= loss tokens per example): the two ranks' first batches differ in tokens
COMPLETION_LENGTHS = (2, 3, 5, 9, 14, 20, 6, 11)


def _examples() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_ids": torch.randint(0, 256, (3 + i % 4,), generator=g).tolist(),
             "completion_ids": torch.randint(0, 256, (n,), generator=g).tolist()}
            for i, n in enumerate(COMPLETION_LENGTHS)]


def _train(output_dir: Path, batch_size: int, max_steps: int = STEPS, resume_from: Path | None = None,
           dropout: float = 0.0) -> dict:
    """Train a fresh tiny drafter against the tiny target (its attention dropout ``dropout``), recording the
    first step's gradients and the examples each micro-batch held. Returns the recording, the final weights
    and the result dict."""
    from distill.models.tiny import tiny_model
    from distill.training import loop as train

    record: dict = {"grads": None, "seen": []}
    adamw = torch.optim.AdamW
    collate = train.collate

    class RecordingAdamW(adamw):
        def step(self, *args, **kwargs):
            if record["grads"] is None:  # step 1, after DDP's all-reduce and clipping
                record["grads"] = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
            return super().step(*args, **kwargs)

    def recording_collate(examples, **kwargs):
        record["seen"].append([tuple(ex["completion_ids"]) for ex in examples])
        return collate(examples, **kwargs)

    target = tiny_model("target", seed=0)
    drafter = tiny_model("drafter", seed=1)
    for module in drafter.modules():  # Qwen2 attention reads it at each training forward
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    torch.optim.AdamW, train.collate = RecordingAdamW, recording_collate
    try:
        result = train.train_drafter(drafter, target, _examples(),
                                     loop_settings(lr=LR, max_steps=max_steps, batch_size=batch_size, seed=SEED,
                                                   checkpoint_every=2),
                                     output_dir=output_dir, progress=False, resume_from=resume_from)
    finally:
        torch.optim.AdamW, train.collate = adamw, collate
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    return {**record, "weights": weights, "result": result}


def _worker(rank: int, port: int, out: str) -> None:
    """One DDP process (``torch.multiprocessing.spawn`` entry): the env:// rendezvous accelerate reads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE), ACCELERATE_USE_CPU="1",
                      HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    recorded = _train(Path(out) / "shared", batch_size=BATCH)
    # resumed from the main process's checkpoint-2 (both processes read it) in another folder
    resumed = _train(Path(out) / "resumed", batch_size=BATCH, resume_from=Path(out) / "shared" / "checkpoint-2")
    recorded["resumed_weights"] = resumed["weights"]
    # with dropout every process draws its own masks: a resume must restore each process's RNG, not the main's
    recorded["dropout_weights"] = _train(Path(out) / "dropout", batch_size=BATCH, dropout=0.3)["weights"]
    recorded["dropout_resumed_weights"] = _train(Path(out) / "dropout-resumed", batch_size=BATCH, dropout=0.3,
                                                 resume_from=Path(out) / "dropout" / "checkpoint-2")["weights"]
    from accelerate import PartialState

    state = PartialState()
    recorded["distributed"] = (state.distributed_type.value, state.num_processes, state.process_index,
                               dist.get_backend())
    torch.save(recorded, Path(out) / f"rank{rank}.pt")
    state.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Both ranks' recordings and the shared output folder of a 2-process run."""
    out = tmp_path_factory.mktemp("ddp")
    return spawn_and_collect(_worker, out, WORLD_SIZE), out


def _tokens(batch: list[tuple]) -> int:
    return sum(len(completion) for completion in batch)


def test_ddp_ranks_run_distributed_on_disjoint_batches(ddp_run):
    ranks, _ = ddp_run
    for r, rank in enumerate(ranks):
        assert rank["distributed"] == ("MULTI_CPU", WORLD_SIZE, r, "gloo")
    # the seeded example stream (epoch e in default_rng([seed, e]).permutation order), cut in batches:
    # batch i goes to rank i % 2, so at step s rank r trains on batch 2 s + r
    examples = _examples()
    stream = [tuple(examples[i]["completion_ids"])
              for epoch in range(2) for i in np.random.default_rng([SEED, epoch]).permutation(len(examples))]
    batches = [stream[i:i + BATCH] for i in range(0, len(stream), BATCH)]
    for step in range(STEPS):  # (the prepared loader may collate one batch ahead: seen has >= STEPS)
        for r, rank in enumerate(ranks):
            assert rank["seen"][step] == batches[WORLD_SIZE * step + r]
        assert not set(ranks[0]["seen"][step]) & set(ranks[1]["seen"][step]), "both ranks got the same examples"
    assert _tokens(ranks[0]["seen"][0]) != _tokens(ranks[1]["seen"][0])  # the cross-process token weighting counts


def test_ddp_gradients_are_synchronised(ddp_run, tmp_path):
    ranks, _ = ddp_run
    grads0, grads1 = ranks[0]["grads"], ranks[1]["grads"]
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
    # ... and they are the gradient of the token-weighted loss over the union of both ranks' batches
    union = _train(tmp_path / "union", batch_size=WORLD_SIZE * BATCH, max_steps=1)
    assert union["seen"][0] == ranks[0]["seen"][0] + ranks[1]["seen"][0]
    for a, b in zip(grads0, union["grads"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # rank 0's own batch alone gives another gradient: without the all-reduce the ranks would drift apart
    local = _train(tmp_path / "local", batch_size=BATCH, max_steps=1)
    assert local["seen"][0] == ranks[0]["seen"][0]
    assert max(float((a - b).abs().max()) for a, b in zip(grads0, local["grads"])) > 1e-3


def test_ddp_matches_single_process_run_and_only_main_writes(ddp_run, tmp_path):
    ranks, out = ddp_run
    shared = out / "shared"
    w0, w1 = ranks[0]["weights"], ranks[1]["weights"]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    single = _train(tmp_path / "single", batch_size=WORLD_SIZE * BATCH)
    for k in w0:
        torch.testing.assert_close(w0[k], single["weights"][k], rtol=1e-4, atol=1e-5)
    # every rank reports the losses of the whole (all-process) step, as the single-process run does
    for rank in ranks:
        assert rank["result"]["tokens_seen"] == single["result"]["tokens_seen"]
        assert rank["result"]["final_loss"] == pytest.approx(single["result"]["final_loss"], rel=1e-4)
    # metrics and checkpoints: written once (main process), with the all-process stream position
    lines = [json.loads(line) for line in (shared / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for got, want in zip(lines, expected):
        assert got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    state = json.loads((shared / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    want_state = json.loads((tmp_path / "single" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert state["examples_seen"] == want_state["examples_seen"] == STEPS * WORLD_SIZE * BATCH
    assert state["tokens_seen"] == want_state["tokens_seen"]
    assert sorted(p.name for p in shared.iterdir()) == ["checkpoint-2", f"checkpoint-{STEPS}", "metrics.jsonl"]


def test_ddp_resume_continues_as_uninterrupted(ddp_run):
    ranks, out = ddp_run
    for rank in ranks:  # same data position, optimizer and scheduler state: the same weights, bit for bit
        w, resumed = rank["weights"], rank["resumed_weights"]
        assert all(torch.equal(w[k], resumed[k]) for k in w)
    lines = [json.loads(line) for line in (out / "resumed" / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(line) for line in (out / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{**m, "tokens_per_s": line["tokens_per_s"]} for m, line in zip(full[2:], lines, strict=True)]


def test_ddp_resume_with_dropout_restores_every_process_rng(ddp_run):
    ranks, out = ddp_run
    state = json.loads((out / "dropout" / "checkpoint-2" / "trainer_state.json").read_text())
    assert len(state["rng_per_process"]) == WORLD_SIZE and state["rng"] == state["rng_per_process"][0]
    assert state["rng_per_process"][0] != state["rng_per_process"][1]  # the ranks' streams differ
    for rank in ranks:
        w, resumed = rank["dropout_weights"], rank["dropout_resumed_weights"]
        assert any(not torch.equal(w[k], rank["weights"][k]) for k in w)  # dropout changed the run
        assert all(torch.equal(w[k], resumed[k]) for k in w)


def test_launcher_processes_that_accelerate_does_not_join_are_refused(monkeypatch, tmp_path):
    # torchrun on a machine without a GPU and without ACCELERATE_USE_CPU=1: every process would train alone
    from distill.errors import DraftsmithError
    from distill.models.tiny import tiny_model
    from distill.training.loop import train_drafter

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DraftsmithError, match="ACCELERATE_USE_CPU"):
        train_drafter(tiny_model("drafter", seed=1), tiny_model("target", seed=0), _examples(),
                      loop_settings(max_steps=1), output_dir=tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------
# the stage command itself: `torchrun --nproc_per_node 2 -m distill.cli distill ...`

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def _cli_env() -> dict:
    # PYTHONPATH: this checkout's code even where another copy is pip-installed (as tests/distill/stages/test_pipeline.py)
    return {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def _draftsmith(*args: str, cwd: Path, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())] if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "distill.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=_cli_env(), timeout=300)


def _distill_runs(outputs: Path) -> list[Path]:
    return sorted(p for p in (outputs / "distill").iterdir() if p.is_dir()) if (outputs / "distill").is_dir() else []


@pytest.fixture(scope="module")
def cli_ddp_run(tmp_path_factory):
    """A generate run, then `draftsmith distill experiment=tiny` in 2 torchrun processes on it."""
    root = tmp_path_factory.mktemp("cli_ddp")
    outputs = root / "outputs"
    proc = _draftsmith("generate", "experiment=tiny", f"outputs={outputs}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _draftsmith("distill", "experiment=tiny", f"outputs={outputs}", cwd=root, nproc=WORLD_SIZE)
    return root, outputs, proc


def test_distill_command_under_torchrun_makes_one_complete_run(cli_ddp_run):
    from distill.runs import COMPLETE, read_manifest

    root, outputs, proc = cli_ddp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _distill_runs(outputs)
    assert len(runs) == 1, runs  # both processes in one run folder
    run = runs[0]
    assert (run / COMPLETE).is_file() and read_manifest(run)["stage"] == "distill"
    state = json.loads((run / "checkpoints" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["data"]["num_processes"] == WORLD_SIZE
    assert state["examples_seen"] == 8 * WORLD_SIZE * 4  # max_steps x processes x batch_size (experiment=tiny)
    # the logger (jsonl) and the metrics were written once, by the main process
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in log if "val_loss" in r] == [0, 8]  # held-out figures before and after
    assert sum("summary" in r for r in log) == 1
    assert (run / "drafter" / "drafter_info.json").is_file()
    # ... and the evaluate stage takes the drafter
    proc = _draftsmith("evaluate", "experiment=tiny", f"outputs={outputs}", f"inputs.distill={run}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = Path(proc.stdout.strip().splitlines()[-1])
    assert report.name == "report.json" and report.is_file()
    assert read_manifest(report.parent)["inputs"]["distill"] == str(run)
    assert json.loads(report.read_text())["outputs_match_target"] is True


@pytest.mark.extra
def test_distill_command_under_torchrun_resumes_unfinished_run(cli_ddp_run, tmp_path):
    from distill.runs import COMPLETE, read_manifest

    root, outputs, _ = cli_ddp_run
    copy = tmp_path / "outputs"
    shutil.copytree(outputs, copy, ignore=shutil.ignore_patterns("evaluate"))
    (old,) = _distill_runs(copy)
    (old / COMPLETE).unlink()  # as if killed after its last checkpoint
    proc = _draftsmith("distill", "experiment=tiny", f"outputs={copy}", "distill.max_steps=10", cwd=root,
                       nproc=WORLD_SIZE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = [p for p in _distill_runs(copy) if p != old]
    assert len(new) == 1 and (new[0] / COMPLETE).is_file()
    manifest = read_manifest(new[0])
    assert manifest["resumed_run"] == str(new[0] / "attempts" / old.name) and not old.exists()
    assert manifest["resumed_from"].endswith("checkpoint-8")
    assert manifest["train"]["steps"] == 10
    lines = (new[0] / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))


def test_other_stages_refuse_several_processes(tmp_path):
    proc = _draftsmith("export", "experiment=tiny", f"outputs={tmp_path}/outputs", cwd=tmp_path, nproc=WORLD_SIZE)
    assert proc.returncode != 0
    assert "only the generate, distill and evaluate stages run in several processes" in proc.stderr
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------
# `torchrun --nproc_per_node 2 -m distill.cli evaluate ...`: the teacher-forced passes shared out, one report

EVAL_PROMPTS = 10  # byte-level prompts of a few hundred tokens: several teacher-forced batches of 4,096 tokens


@pytest.fixture(scope="module")
def evaluate_one_and_two(tmp_path_factory):
    """One tiny generate + distill run, evaluated in 1 and in 2 processes: ``{nproc: (report, manifest)}``."""
    from distill.runs import read_manifest

    root = tmp_path_factory.mktemp("evaluate_ddp")
    outputs = root / "outputs"
    for stage in ("generate", "distill"):
        proc = _draftsmith(stage, "experiment=tiny", f"evaluate.num_prompts={EVAL_PROMPTS}", "distill.max_steps=2",
                           f"outputs={outputs}", cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = _distill_runs(outputs)
    reports = {}
    for nproc in (1, WORLD_SIZE):
        proc = _draftsmith("evaluate", "experiment=tiny", f"evaluate.num_prompts={EVAL_PROMPTS}", f"inputs.distill={run}",
                           "evaluate.hf_assisted=false", "evaluate.stock_drafter=false", "evaluate.timed_prompts=1",
                           # a fixed K: the recommended one rests on timings, which differ between the two runs
                           "evaluate.draft_length=decode", f"outputs={root}/out{nproc}", cwd=root, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = Path(proc.stdout.strip().splitlines()[-1])
        assert report.name == "report.json"
        assert [p.parent for p in (root / f"out{nproc}").glob("evaluate/*/report.json")] == [report.parent]
        reports[nproc] = (json.loads(report.read_text()), read_manifest(report.parent))
    return outputs, reports


def _simulated(section: dict) -> dict:
    """The figures of a ``simulated`` section that do not depend on timings (tau, acceptance, their intervals)."""
    keys = ("num_prompts", "num_tokens", "acceptance_rate", "mean_accepted_tokens")
    per_k = {k: (v["acceptance_rate"], v["mean_accepted_tokens"]) for k, v in section["per_k"].items()}
    return {**{k: section[k] for k in keys}, "per_k": per_k, "ci95": {k: section["ci95"][k] for k in keys[2:]}}


def test_evaluate_in_two_processes_reports_the_single_process_acceptance(evaluate_one_and_two):
    from distill.data.generated import load_generated
    from distill.data.prompts import encode_prompt
    from distill.models.tiny import tiny_tokenizer
    from decode.teacher_forcing import batches_by_length

    outputs, reports = evaluate_one_and_two
    (one, _), (two, manifest) = reports[1], reports[WORLD_SIZE]
    assert manifest["processes"] == WORLD_SIZE and reports[1][1]["processes"] == 1
    assert _simulated(two["simulated"]) == _simulated(one["simulated"])
    assert _simulated(two["baseline_drafter"]["simulated"]) == _simulated(one["baseline_drafter"]["simulated"])
    assert two["paired_difference"] == one["paired_difference"]
    assert two["simulated"]["num_prompts"] == EVAL_PROMPTS
    # both processes had batches to pass: the split was real
    (gen,) = [p for p in (outputs / "generate").iterdir() if p.is_dir()]
    _, held_out, _ = load_generated(gen)
    lengths = [len(encode_prompt(tiny_tokenizer(), p)) + 24 for p in held_out[:EVAL_PROMPTS]]
    assert len(batches_by_length(lengths, 4096, max_rows=64)) >= WORLD_SIZE


# ---------------------------------------------------------------------------------------------
# `torchrun --nproc_per_node N -m distill.cli generate ...`: the shards shared out, one dataset

# batches of 2 over 5 held-out prompts: both processes answer some of them
GENERATE = ("generate", "experiment=tiny", "generate.num_prompts=14", "generate.batch_size=2",
            "evaluate.num_prompts=5")


def _generated(outputs: Path) -> tuple[list[dict], dict[str, str], dict]:
    """The one generate run under ``outputs``: its rows, its other files' texts and its manifest."""
    import datasets

    from distill.runs import COMPLETE, read_manifest

    (run,) = [p for p in (outputs / "generate").iterdir() if p.is_dir()]
    assert (run / COMPLETE).is_file()
    texts = {p.name: p.read_text() for p in run.iterdir() if p.name.startswith("answers-") or p.name == "eval_prompts.jsonl"}
    return datasets.load_from_disk(str(run / "dataset")).to_list(), texts, read_manifest(run)


@pytest.fixture(scope="module")
def generate_one_and_two(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_ddp")
    runs = {}
    for nproc in (1, WORLD_SIZE):
        proc = _draftsmith(*GENERATE, f"outputs={root}/out{nproc}", cwd=root, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = _generated(root / f"out{nproc}")
    return root, runs


def test_generate_in_two_processes_writes_the_single_process_dataset(generate_one_and_two):
    _, runs = generate_one_and_two
    (rows1, files1, manifest1), (rows2, files2, manifest2) = runs[1], runs[WORLD_SIZE]
    assert len(rows1) == 14 and rows2 == rows1  # row for row, in prompt order
    assert files2 == files1 and any(name.startswith("answers-") for name in files1)  # held-out answers too
    assert json.loads(next(v for k, v in files1.items() if k.startswith("answers-")))[0]  # ... not empty
    assert manifest1["processes"] == 1 and manifest2["processes"] == WORLD_SIZE


@pytest.mark.extra
def test_generate_resumes_with_another_number_of_processes(generate_one_and_two, tmp_path):
    root, runs = generate_one_and_two
    out = tmp_path / "outputs"
    proc = _draftsmith(*GENERATE[:2], "generate.num_prompts=8", *GENERATE[3:], f"outputs={out}", cwd=root,
                       nproc=WORLD_SIZE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(out / "generate")  # keep only the shards, as a killed run would
    # 3 processes for 4 shards of which 2 are done: one process has nothing to answer
    proc = _draftsmith(*GENERATE, f"outputs={out}", cwd=root, nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming, 2/4 shards already finished" in proc.stdout
    rows, files, _ = _generated(out)
    assert rows == runs[1][0] and files == runs[1][1]
