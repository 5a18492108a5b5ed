"""The whole pipeline end to end on tiny random models, through the real CLI.

Commands that do work run in child processes (:func:`draftsmith`; one torch thread on the tiny models); a command
refused before any model loads runs through the same entry point in this process (``cli_in_process``: the same
exit code and messages, without a child's 3-5 s of start-up).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from distill.runs import COMPLETE
from tests.distill.test_config import cli_in_process

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
REPORT_KEYS = ("acceptance_rate", "mean_accepted_tokens", "draft_length", "target_tokens_per_s",
               "speculative_tokens_per_s", "speedup", "num_prompts", "new_tokens")


def draftsmith(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # PYTHONPATH: run this checkout's code even where another copy is pip-installed.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "distill.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


# Child processes on the tiny models get one torch thread, as `one_thread` (conftest.py) gives the tests in this
# process: with two threads on a shared 2-core CPU a tiny forward pays for thread start-up, not for matmuls, and
# the tiny pipeline takes ~55 s instead of ~18 s. The real-model run keeps torch's default.
TINY_THREADS = {"OMP_NUM_THREADS": "1"}


def draftsmith_tiny(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``draftsmith ARGS`` in a child process with one torch thread (``TINY_THREADS``): commands on tiny models."""
    return draftsmith(*args, cwd=cwd, env=TINY_THREADS)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One finished tiny pipeline, ``(root, proc)``, that the tests of this module read (its report is the last
    line of ``proc.stdout``) and start their own runs from; a test that changes a run's files copies it first."""
    root = tmp_path_factory.mktemp("pipeline")
    # with one budget point before the end, measured by evaluate (test_the_report_holds_the_budget_curve)
    proc = draftsmith_tiny("pipeline", "experiment=tiny", f"outputs={root}/outputs", "distill.checkpoint_at=[4]",
                           "evaluate.checkpoints=true", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc


def test_pipeline_prints_report_path_last(tiny_run):
    root, proc = tiny_run
    last = proc.stdout.strip().splitlines()[-1]
    report_path = Path(last)
    assert report_path.name == "report.json" and report_path.is_file()
    report = json.loads(report_path.read_text())
    for key in REPORT_KEYS:
        assert key in report, key
    # the undistilled drafter is simulated, not timed (evaluate.timed_drafters=distilled)
    assert report["baseline_drafter"]["timed"] is False
    assert set(report["baseline_drafter"]["simulated"]) >= {"acceptance_rate", "mean_accepted_tokens", "draft_length"}
    # decoded at the K its own simulation recommends (evaluate.draft_length=recommended), not decode.draft_length=3
    chosen = report["draft_length_from"]
    by_k = {int(k): v for k, v in chosen["predicted_speedup_by_k"].items()}
    assert report["draft_length"] == chosen["chosen"] == max(by_k, key=lambda k: (by_k[k], -k))
    assert chosen["decode_draft_length"] == 3 and report["decode"]["draft_length_used"] == report["draft_length"]
    assert report["simulated"]["draft_length"] == report["draft_length"]
    assert report["simulated"]["recommended_draft_length"] == report["draft_length"]  # the same costs, the same pick
    assert len(report["verify_cost_rounds"]) == 5 and len(report["verify_costs"]) >= 9
    assert report["num_prompts"] == 3
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    assert 1.0 <= report["mean_accepted_tokens"] <= report["draft_length"] + 1
    assert report["outputs_match_target"] is True  # greedy, fp32 tiny models: lossless
    assert set(report["stages"]) == {"generate", "distill", "evaluate", "export"}
    markdown = (report_path.parent / "report.md").read_text()
    assert markdown.startswith("# draftsmith evaluation report")
    assert f"The timed runs decoded at K = {report['draft_length']}, chosen this way" in markdown


def test_the_report_holds_the_budget_curve(tiny_run):
    _, proc = tiny_run
    report_path = Path(proc.stdout.strip().splitlines()[-1])
    report = json.loads(report_path.read_text())
    points = report["budget_curve"]["points"]
    assert [p["drafter"] for p in points] == ["undistilled", "checkpoint-4", "distilled"]
    assert [p["step"] for p in points] == [0, 4, 8]
    assert points[0]["training_tokens"] == 0 < points[1]["training_tokens"] < points[2]["training_tokens"]
    checkpoint = report["compared_drafters"]["checkpoint-4"]
    assert points[1]["mean_accepted_tokens"] == checkpoint["simulated"]["mean_accepted_tokens"]
    assert points[1]["tau_minus_undistilled"]["mean"] == pytest.approx(
        checkpoint["simulated"]["mean_accepted_tokens"] - report["baseline_drafter"]["simulated"]["mean_accepted_tokens"])
    # the checkpoint has the distilled drafter's shapes: its c is that one's, not timed again
    costs = report["side_by_side_costs"]
    assert costs["cost_ratios"]["checkpoint-4"] == costs["cost_ratios"]["distilled"]
    assert points[2]["predicted_speedup_ratio_to_stock"]["ratio"] == report["against_stock"]["predicted_speedup_ratio"]["ratio"]
    assert report["budget_curve"]["fit"]["points"] == 2
    markdown = (report_path.parent / "report.md").read_text()
    assert "## Training budget" in markdown and "| checkpoint-4 |" in markdown
    assert f"measured on the same {report['simulated']['num_prompts']} prompts" in markdown
    assert (report_path.parent / "budget_curve.png").is_file()


def test_every_stage_folder_is_complete(tiny_run):
    root, proc = tiny_run
    run = Path(proc.stdout.strip().splitlines()[-1]).parent.parent
    for stage in ("generate", "distill", "evaluate", "export"):
        assert (run / stage / COMPLETE).is_file(), stage
        manifest = json.loads((run / stage / "manifest.json").read_text())
        assert manifest["stage"] == stage
        # what the speed figures depend on, this machine's own answers
        assert manifest["hardware"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert manifest["hardware"]["cpu_count"] == os.cpu_count() and isinstance(manifest["hardware"]["bf16_fast"], bool)


def test_generated_dataset_is_disjoint_from_eval_prompts(tiny_run):
    from datasets import load_from_disk

    root, proc = tiny_run
    run = Path(proc.stdout.strip().splitlines()[-1]).parent.parent
    data = load_from_disk(str(run / "generate" / "dataset"))
    assert len(data) == 8
    assert {"prompt_id", "prompt_ids", "completion_ids", "temperature", "target_fingerprint"} <= set(data.column_names)
    assert all(len(c) >= 1 for c in data["completion_ids"])
    eval_ids = {json.loads(line)["id"] for line in (run / "generate" / "eval_prompts.jsonl").read_text().splitlines()}
    assert eval_ids and not eval_ids & set(data["prompt_id"])


def test_export_loads_with_from_pretrained(tiny_run):
    root, proc = tiny_run
    run = Path(proc.stdout.strip().splitlines()[-1]).parent.parent
    exported = run / "export" / "drafter-hf"
    model = AutoModelForCausalLM.from_pretrained(exported)
    card = (exported / "README.md").read_text()
    assert "Draft model for `tiny-target`" in card
    # the undistilled drafter was simulated, not timed: its exact figures fill its column
    report = json.loads((run / "evaluate" / "report.json").read_text())
    sim, base = report["simulated"], report["baseline_drafter"]["simulated"]
    assert (f"| acceptance rate (exact, {sim['num_prompts']} held-out prompts) | {base['acceptance_rate']:.3f} | "
            f"{sim['acceptance_rate']:.3f} |") in card
    assert f"| not timed | {report['speedup']:.2f}x |" in card
    manifest = json.loads((run / "distill" / "manifest.json").read_text())
    assert f"({manifest['num_train_examples']} training examples from 1 generate run, " \
           f"{manifest['num_val_examples']} held out for validation)" in card
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
    report = json.loads((run / "evaluate" / "report.json").read_text())
    assert f"the target alone ran at {report['target_tokens_per_s']:.2f} tokens/s" in card
    # readable by other users (a serving account), whatever mkdtemp and safetensors made
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in [exported, *exported.rglob("*")])


def test_the_model_card_says_when_its_speedups_are_not_to_be_trusted():
    from distill.stages.export import model_card

    info = {"target_name": "t", "base_name": "b", "init": "sibling", "method": "lora", "loss": "fkl",
            "target_fingerprint": "f"}
    report = {"engine": "e", "draft_length": 3, "decode": {}, "num_prompts": 3, "acceptance_rate": 0.06,
              "mean_accepted_tokens": 1.1, "speedup": 0.3, "target_tokens_per_s": 5.0, "cpu_busy_before": 0.46,
              "measured_over_theoretical": 0.9, "baseline_drafter": {"acceptance_rate": 0.05, "mean_accepted_tokens": 1.1,
                                                                     "speedup": 6.7, "measured_over_theoretical": 22.8}}
    card = model_card(info, report)
    assert "**The timing was disturbed**: other processes used 46% of the CPUs when the timing started" in card
    assert "The undistilled drafter's speedup is 22.8x what the cost model predicts" in card
    assert "distilled drafter's speedup" not in card.replace("undistilled", "")  # 0.9: within reason
    calm = model_card(info, {**report, "cpu_busy_before": 0.01, "baseline_drafter": {}})
    assert "disturbed" not in calm and "cost model predicts" not in calm


def test_export_works_as_transformers_assistant_model(tiny_run):
    """The exported folder as ``assistant_model`` of the target in transformers: output identical to plain greedy."""
    from distill.models.loading import load_model

    root, proc = tiny_run
    exported = Path(proc.stdout.strip().splitlines()[-1]).parent.parent / "export" / "drafter-hf"
    target, tokenizer, _ = load_model("tiny-target")
    assistant = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                  attention_mask=torch.ones_like(ids))
    plain = target.eval().generate(ids, **kwargs)
    assisted = target.generate(ids, assistant_model=assistant, num_assistant_tokens=3, **kwargs)
    assert torch.equal(assisted, plain)


def test_export_writes_a_gguf_when_asked(tiny_run, tmp_path):
    import gguf

    root, _ = tiny_run
    dest = tmp_path / "with-gguf"
    proc = draftsmith_tiny("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={dest}",
                           "export.gguf=true", "export.gguf_dtype=f32", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reader = gguf.GGUFReader(dest / "drafter.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen2"
    reloaded = AutoModelForCausalLM.from_pretrained(dest, gguf_file="drafter.gguf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)  # the same bf16 weights, in f32
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, original(ids).logits, atol=1e-5)


def test_single_stages_chain_through_outputs(tiny_run, tmp_path):
    """`draftsmith distill` without inputs reads the newest finished generate run."""
    root, _ = tiny_run
    out = root / "outputs"
    proc = draftsmith_tiny("distill", "experiment=tiny", f"outputs={out}", "distill.max_steps=2", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    distill_runs = sorted((out / "distill").glob("*/COMPLETE"))
    assert distill_runs


def test_evaluate_compares_other_drafters_in_the_same_run(tiny_run, tmp_path):
    root, pipeline = tiny_run
    distill_run = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "distill"
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"outputs={tmp_path}/eval", f"inputs.distill={distill_run}",
                           "evaluate.compare_drafters=[tiny-drafter]", "evaluate.compare_vocab_sizes=[64]",
                           "evaluate.hf_assisted=false", "evaluate.timed_drafters=all", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report_path] = list((tmp_path / "eval").glob("evaluate/*/report.json"))
    report = json.loads(report_path.read_text())
    other = report["compared_drafters"]["tiny-drafter"]
    assert other["outputs_match_target"] is True and 0 <= other["acceptance_rate"] <= 1
    assert other["target_tokens_per_s"] == report["target_tokens_per_s"]  # one target-alone measurement
    markdown = (report_path.parent / "report.md").read_text()
    assert "`tiny-drafter`" in markdown
    # the drafter is cut from tiny-target: the stock tiny-target is measured too, and every other drafter
    # (its 64-token head among them) is paired against it
    assert report["drafter_stock"] == "tiny-target"
    assert set(report["compared_drafters"]) == {"tiny-drafter", "tiny-target", "tiny-target (64-token head)"}
    # the stock drafter and its reduced head share their layers: one teacher-forced pass of them for both
    assert "tiny-target, tiny-target (64-token head): one teacher-forced pass" in proc.stdout + proc.stderr
    for section in (report, report["baseline_drafter"], other, report["compared_drafters"]["tiny-target (64-token head)"]):
        against = section["against_stock"]
        lo, hi = against["predicted_speedup_ratio"]["ci95"]
        assert lo <= against["predicted_speedup_ratio"]["ratio"] <= hi
        assert against["tau_difference"]["mean_accepted_tokens"] == pytest.approx(
            section["simulated"]["mean_accepted_tokens"]
            - report["compared_drafters"]["tiny-target"]["simulated"]["mean_accepted_tokens"])
    assert "against_stock" not in report["compared_drafters"]["tiny-target"]
    assert "Against the stock drafter (`tiny-target`" in markdown
    assert markdown.index("## In short") < markdown.index("## Acceptance on every held-out prompt")
    assert report["hardware"]["cpu_count"] == os.cpu_count()
    # drafter.* of this command says 2 layers (the whole tiny target: accepted always), but the baseline is the
    # drafter the run started from (1 layer), as in the pipeline's own report
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"outputs={tmp_path}/eval2", f"inputs.distill={distill_run}",
                           "drafter.num_layers=2", "evaluate.hf_assisted=false", "evaluate.draft_length=decode",
                           cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [again] = list((tmp_path / "eval2").glob("evaluate/*/report.json"))
    pipeline_report = json.loads(Path(pipeline.stdout.strip().splitlines()[-1]).read_text())
    again_report = json.loads(again.read_text())
    # the pipeline decoded at its recommended K; its simulation at K = 3 is this run's
    assert again_report["baseline_drafter"]["simulated"]["mean_accepted_tokens"] == \
        pipeline_report["baseline_drafter"]["simulated"]["per_k"]["3"]["mean_accepted_tokens"] < 1 + 3
    # by default only the distilled drafter is decoded in real time; the others are simulated, at its K
    for section in (again_report["baseline_drafter"], again_report["compared_drafters"]["tiny-target"]):
        assert section["timed"] is False and "speedup" not in section and "timed_decoding" not in section["seconds"]
        assert section["simulated"]["draft_length"] == again_report["draft_length"]
        assert section["draft_length_choice"]["cost_ratio"] == section["simulated"]["cost_ratio"] > 0
    assert "timed_decoding" in again_report["seconds"] and again_report["speedup"] > 0
    assert again_report["draft_length"] == 3 and "draft_length_from" not in again_report  # decode.draft_length
    markdown = (again.parent / "report.md").read_text()
    assert "Not timed here (`evaluate.timed_drafters=distilled`): the undistilled drafter, `tiny-target`" in markdown
    assert "| figure | distilled drafter |" in markdown and "timed speedup ratio" not in markdown


def test_evaluate_on_a_named_prompt_file_counts_prompts_seen_in_training(tiny_run, tmp_path):
    """evaluate.prompts=<file>: its prompts replace the held-out ones; one that was trained on is counted."""
    from datasets import load_from_disk

    from distill.data.prompts import load_prompts
    root, pipeline = tiny_run
    distill_run = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "distill"
    trained_id = load_from_disk(str(distill_run.parent / "generate" / "dataset"))["prompt_id"][0]
    [trained] = [p for p in load_prompts("humaneval") if p.id == trained_id]
    prompts = _prompt_file(tmp_path / "mine.jsonl", [
        {"id": "new", "prompt": "def fib(n):"}, {"id": "seen", "messages": trained.messages},
        {"id": "third", "prompt": "Write a haiku about caches."}])
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"outputs={tmp_path}/eval", f"inputs.distill={distill_run}",
                           f"evaluate.prompts={prompts}", "evaluate.num_prompts=2", "evaluate.hf_assisted=false",
                           cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 of the 2 prompts" in proc.stdout
    [report_path] = list((tmp_path / "eval").glob("evaluate/*/report.json"))
    report = json.loads(report_path.read_text())
    assert report["prompt_ids"] == ["file/new", "file/seen"] and report["num_prompts"] == 2
    assert report["eval_prompts"] == {"source": str(prompts), "seen_in_training": 1}
    assert "**1 of them in the training data**" in (report_path.parent / "report.md").read_text()
    # a malformed file is refused before any model loads, and no run folder is left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    proc = cli_in_process("evaluate", "experiment=tiny", f"outputs={tmp_path}/bad", f"inputs.distill={distill_run}",
                          f"evaluate.prompts={bad}", cwd=root)
    assert proc.returncode == 2 and "line 1" in proc.stderr and "prompt" in proc.stderr, proc.stderr[-2000:]
    assert not list((tmp_path / "bad").glob("evaluate/*/report.json"))


def test_validate_every_without_held_out_examples_is_refused_before_training(tiny_run, tmp_path):
    root, pipeline = tiny_run
    gen = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    proc = cli_in_process("distill", "experiment=tiny", f"inputs.generate={gen}", "distill.validate_every=2",
                          "distill.val_fraction=0", f"outputs={tmp_path}/out", cwd=root)
    assert proc.returncode == 2 and "distill.val_fraction" in proc.stderr, proc.stderr[-1000:]


def test_generate_resumes_from_finished_shards(tiny_run):
    root, _ = tiny_run
    out = root / "outputs"
    proc = draftsmith_tiny("generate", "experiment=tiny", f"outputs={out}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming, 2/2 shards already finished" in proc.stdout


def test_more_prompts_answer_only_the_new_ones(tiny_run, tmp_path):
    """Raising generate.num_prompts keeps the finished shards: the smaller run's rows come back unchanged."""
    import datasets

    root, pipeline = tiny_run
    out = root / "outputs"
    small = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    proc = draftsmith_tiny("generate", "experiment=tiny", "generate.num_prompts=14", f"outputs={out}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming, 2/4 shards already finished" in proc.stdout  # 8 prompts = 2 full shards of 4
    [grown] = [m.parent for m in out.glob("generate/*/manifest.json")
               if json.loads(m.read_text()).get("num_train_prompts") == 14]
    before, after = (datasets.load_from_disk(str(p / "dataset")) for p in (small, grown))
    assert len(after) == 14 and after.select(range(8)).to_list() == before.to_list()
    ids = [json.loads(line)["id"] for p in (small, grown) for line in (p / "eval_prompts.jsonl").open()]
    assert ids[:len(ids) // 2] == ids[len(ids) // 2:]  # the held-out prompts did not move
    assert json.loads((grown / "manifest.json").read_text())["data_identity"] != \
        json.loads((small / "manifest.json").read_text())["data_identity"]


def test_export_never_replaces_foreign_folders(tiny_run, tmp_path):
    root, _ = tiny_run
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("keep me")
    proc = cli_in_process("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={precious}",
                          "export.overwrite=true", cwd=root)
    assert proc.returncode == 2 and "not a draftsmith export" in proc.stderr
    assert (precious / "thesis.txt").read_text() == "keep me"
    # an earlier export is replaced only when asked
    dest = tmp_path / "drafter"
    assert draftsmith_tiny("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={dest}",
                           cwd=root).returncode == 0
    again = cli_in_process("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={dest}", cwd=root)
    assert again.returncode == 2 and "export.overwrite=true" in again.stderr
    assert draftsmith_tiny("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={dest}",
                           "export.overwrite=true", cwd=root).returncode == 0
    # ... and never when the user put files of their own in it
    (dest / "my_notes.txt").write_text("keep me too")
    proc = cli_in_process("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={dest}",
                          "export.overwrite=true", cwd=root)
    assert proc.returncode == 2 and "my_notes.txt" in proc.stderr, proc.stderr[-1000:]
    assert (dest / "my_notes.txt").read_text() == "keep me too" and (dest / "config.json").is_file()
    # an empty folder made beforehand is a fine destination
    empty = tmp_path / "empty"
    empty.mkdir()
    assert draftsmith_tiny("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={empty}",
                           cwd=root).returncode == 0
    assert (empty / "config.json").is_file() and not empty.with_name("empty.new").exists()


def test_export_never_replaces_a_run_folders_files(tiny_run, tmp_path, monkeypatch):
    root, proc = tiny_run
    drafter = Path(proc.stdout.strip().splitlines()[-1]).parent.parent / "distill" / "drafter"
    before = {p.name: p.read_bytes() for p in drafter.iterdir() if p.is_file()}
    proc = cli_in_process("export", "experiment=tiny", f"outputs={root}/outputs", f"export.path={drafter}",
                          "export.overwrite=true", "export.dtype=bfloat16", cwd=root)
    assert proc.returncode == 2 and "inside the distill run" in proc.stderr, proc.stderr[-1000:]
    assert {p.name: p.read_bytes() for p in drafter.iterdir() if p.is_file()} == before
    # a destination this user may not write to is refused with a message, before any work (checked in-process:
    # root, as CI runs, may write anywhere)
    from distill.errors import DraftsmithError
    from distill.stages import export as export_module

    monkeypatch.setattr(export_module.os, "access", lambda path, mode: False)
    with pytest.raises(DraftsmithError, match="not writable by this user"):
        export_module.check_export_destination(tmp_path / "ro" / "drafter", overwrite=False)


def test_pipeline_preflight_refuses_before_generating(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("a folder of the user's")
    proc = cli_in_process("pipeline", "experiment=tiny", f"outputs={tmp_path}/outputs", f"export.path={taken}",
                          cwd=tmp_path)
    assert proc.returncode == 2 and "not a draftsmith export" in proc.stderr
    assert "[1/4]" not in proc.stdout


def test_pipeline_refuses_a_missing_evaluate_prompts_file_before_generating(tmp_path):
    proc = cli_in_process("pipeline", "experiment=tiny", f"outputs={tmp_path}/outputs",
                          f"evaluate.prompts={tmp_path}/missing.jsonl", cwd=tmp_path)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr and "evaluate.prompts" in proc.stderr, proc.stderr[-2000:]
    assert "[1/4]" not in proc.stdout


def test_pipeline_refuses_layers_the_base_model_lacks_before_generating(tmp_path):
    for override, says in (("drafter.layers=[0,7]", "decoder layers 0..1"), ("drafter.num_layers=5", "at most 2"),
                           ("evaluate.compare_drafters=[no-such-drafter]", "no-such-drafter"),
                           (f"distill.resume={tmp_path}/nothing", "not a checkpoint-<step> folder")):
        proc = cli_in_process("pipeline", "experiment=tiny", override, f"outputs={tmp_path}/outputs", cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-500:]
        assert "[1/4]" not in proc.stdout


def test_edited_prompt_file_is_not_served_from_stale_shards(tmp_path):
    prompts = tmp_path / "prompts.txt"
    args = ["generate", "experiment=tiny", "data=file", f"data.path={prompts}", f"outputs={tmp_path}/outputs",
            "generate.num_prompts=4", "evaluate.num_prompts=1"]
    prompts.write_text("".join(f"write a haiku about apples, number {i}\n" for i in range(6)))
    assert draftsmith_tiny(*args, cwd=tmp_path).returncode == 0
    prompts.write_text("".join(f"write quicksort in Rust, variant {i}\n" for i in range(6)))
    proc = draftsmith_tiny(*args, cwd=tmp_path)
    assert proc.returncode == 0 and "resuming" not in proc.stdout


def test_incomplete_input_is_refused(tmp_path):
    bad = tmp_path / "gen"
    bad.mkdir()
    proc = cli_in_process("distill", "experiment=tiny", f"outputs={tmp_path}/outputs", f"inputs.generate={bad}",
                          cwd=tmp_path)
    assert proc.returncode == 2 and "is not a generate run folder" in proc.stderr, proc.stderr[-1000:]
    (bad / "config.yaml").write_text("stage: generate\n")  # started (StageRun.start), never finished
    proc = cli_in_process("distill", "experiment=tiny", f"outputs={tmp_path}/outputs", f"inputs.generate={bad}",
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert "COMPLETE" in proc.stderr and "did not finish" in proc.stderr


@pytest.mark.real
@pytest.mark.slow
def test_real_pipeline_smoke(qwen05, tmp_path):
    """experiment=quick cut down to a couple of minutes: real 0.5B target, 4-layer drafter, every stage."""
    proc = draftsmith("pipeline", "experiment=quick", f"outputs={tmp_path}/outputs", "generate.num_prompts=4",
                      "generate.max_new_tokens=16", "distill.max_steps=3", "distill.batch_size=2",
                      "evaluate.num_prompts=2", "decode.max_new_tokens=16", "evaluate.hf_assisted=false",
                      "evaluate.stock_drafter=false",  # the stock 0.5B is the target here; tiny runs test it
                      "evaluate.timed_drafters=all",  # the undistilled drafter decoded too: lossless in fp32
                      "target.dtype=float32", "drafter.dtype=float32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    assert report["target"]["name"] == "qwen2.5-coder-0.5b-instruct"
    assert report["drafter"]["init"] == "layers" and report["drafter"]["num_layers"] == 4
    assert report["outputs_match_target"] is True  # fp32: greedy speculative == greedy target
    assert report["baseline_drafter"]["outputs_match_target"] is True
    assert report["new_tokens"] > 0


def test_malformed_prompt_lines_are_fatal_or_skipped_and_counted(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    good = [json.dumps({"prompt": f"write a poem about the number {i}"}) for i in range(6)]
    prompts.write_text("\n".join(good[:3] + ["{not json", '{"prompt": ""}'] + good[3:]) + "\n")
    args = ["generate", "experiment=tiny", "data=file", f"data.path={prompts}", f"outputs={tmp_path}/outputs",
            "generate.num_prompts=4", "evaluate.num_prompts=1"]
    fatal = cli_in_process(*args, cwd=tmp_path)
    assert fatal.returncode == 2 and "line 4" in fatal.stderr and "line 5" in fatal.stderr
    assert "data.on_bad_line=skip" in fatal.stderr
    skipped = draftsmith_tiny(*args, "data.on_bad_line=skip", cwd=tmp_path)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped 2 malformed line(s)" in skipped.stdout
    [run] = list((tmp_path / "outputs" / "generate").glob("*"))
    lines = json.loads((run / "manifest.json").read_text())["skipped_prompt_lines"]
    assert [line.split(":")[0] for line in lines] == ["line 4", "line 5"]


def test_prompt_longer_than_the_context_is_refused_before_generating(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short prompt one\nshort prompt two\n" + "x" * 2100 + "\nshort prompt three\n")
    proc = cli_in_process("generate", "experiment=tiny", "data=file", f"data.path={prompts}",
                          f"outputs={tmp_path}/outputs", "generate.num_prompts=3", "evaluate.num_prompts=1",
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert "do not fit the target's context of 2048 tokens" in proc.stderr and "file/prompts/3" in proc.stderr
    assert not list((tmp_path / "outputs").glob(".shards/*/shard-*"))  # nothing generated


def test_drafter_for_another_target_is_refused_at_evaluate_and_export(tiny_run, tmp_path):
    root, _ = tiny_run
    for stage in ("evaluate", "export"):
        proc = cli_in_process(stage, "experiment=tiny", "target.name=tiny-drafter", f"outputs={root}/outputs",
                              f"export.path={tmp_path / 'x'}", cwd=root)
        assert proc.returncode == 2, stage
        assert "was tuned for target 'tiny-target'" in proc.stderr and "target.name=tiny-target" in proc.stderr


@pytest.mark.extra
def test_layer_choice_script_scores_candidate_layers(tmp_path):
    out = tmp_path / "outputs"
    proc = draftsmith_tiny("generate", "experiment=tiny", "generate.store_top_k=8", f"outputs={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [gen] = list(out.glob("generate/*"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **TINY_THREADS}
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "layer_choice.py"), "--generate", str(gen),
                          "--drafter", "tiny-target", "--dtype", "float32", "--max-seq-len", "2048", "--first", "1", "2", "--layers", "1",
                          "--out", str(tmp_path / "choice")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "choice" / "layer_choice.json").read_text())["rows"]
    assert sorted(map(tuple, (r["layers"] for r in rows))) == [(0,), (0, 1), (1,)]
    whole = next(r for r in rows if r["layers"] == [0, 1])  # all layers of the tiny target = the target itself
    assert whole["top1_agreement"] == 1.0 and rows == sorted(rows, key=lambda r: -r["top1_agreement"])
    assert "| 2 layers [0-1] | 2 | 1.000 |" in (tmp_path / "choice" / "layer_choice.md").read_text()
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "layer_choice.py"), "--generate", str(gen),
                          "--drafter", "tiny-target", "--layers", "0,5"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert bad.returncode == 2 and "0..1" in bad.stderr


def test_drafter_quantization_script_scores_the_variants(tiny_run, tmp_path):
    # the tiny pipeline's generate run: what `draftsmith generate experiment=tiny` writes, without running it again
    gen = Path(tiny_run[1].stdout.strip().splitlines()[-1]).parent.parent / "generate"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **TINY_THREADS}
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "drafter_quantization.py"), "--generate", str(gen),
                          "--target", "tiny-target", "--drafter", "tiny-target", "--dtype", "float32",
                          "--max-new-tokens", "12", "--out", str(tmp_path / "q")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    variants = json.loads((tmp_path / "q" / "drafter_quantization.json").read_text())["variants"]
    assert list(variants) == ["float32", "torch int8 (per-tensor)", "int8, per-token activations, per-tensor weights",
                              "int8, per-tensor activations, per-channel weights",
                              "draftsmith int8 (per-token, per-channel)"]
    assert variants["float32"]["agreement"] == 1.0  # the target drafting for itself, read as the decoder reads it
    assert all(0 < v["agreement"] <= 1 and v["ms_per_token"] > 0 for v in variants.values())
    assert "| float32 | 1.000 |" in (tmp_path / "q" / "drafter_quantization.md").read_text()


@pytest.mark.parametrize("script", ["benchmark_decoder.py", "drafter_quantization.py"])
def test_scripts_name_a_model_that_is_not_there_without_a_traceback(tiny_run, tmp_path, script):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    # a finished generate run (the tiny pipeline's), so that the script gets as far as loading the target
    generate = Path(tiny_run[1].stdout.strip().splitlines()[-1]).parent.parent / "generate"
    extra = ["--generate", str(generate)] if script == "drafter_quantization.py" else []
    run = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--target", "no-such-model", *extra],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 1 and f"{script}: error: " in run.stderr and "no-such-model" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def _prompt_file(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_distill_adds_the_examples_of_extra_generate_runs(tiny_run, tmp_path):
    """inputs.extra_generate: its answers are trained on too, minus the main run's held-out prompts and repeats."""
    import datasets

    root, pipeline = tiny_run
    main = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    held_out = [json.loads(line) for line in (main / "eval_prompts.jsonl").open()]
    trained = datasets.load_from_disk(str(main / "dataset"))
    records = [{"id": "held-out", "messages": held_out[0]["messages"]},  # evaluate's prompt: must not be trained
               {"id": "new-0", "messages": [{"role": "user", "content": "write a haiku about pears"}]},
               {"id": "new-1", "messages": [{"role": "user", "content": "sort a list in Go"}]},
               {"id": "new-2", "messages": [{"role": "user", "content": "explain a hash map"}]},
               {"id": "new-3", "messages": [{"role": "user", "content": "what is a monad"}]}]
    prompts = _prompt_file(tmp_path / "more.jsonl", records)
    proc = draftsmith_tiny("generate", "experiment=tiny", "data=file", f"data.path={prompts}", "generate.num_prompts=4",
                           "evaluate.num_prompts=1", f"outputs={tmp_path}/more", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same prompts answered twice, in two output roots: the second a copy of the first (greedy answers, the
    # rows a second generate would write), a run of its own to distill
    shutil.copytree(tmp_path / "more", tmp_path / "again")
    extra, again = [p.parent for name in ("more", "again") for p in (tmp_path / name).glob("generate/*/COMPLETE")]
    answered = [r for r in records if r["id"] != json.loads((extra / "eval_prompts.jsonl").read_text())["id"]]
    leaks = sum(r["id"] == "held-out" for r in answered)  # evaluate's prompt, if extra answered it

    proc = draftsmith_tiny("distill", "experiment=tiny", f"inputs.generate={main}",
                           f"inputs.extra_generate=[{extra},{again}]", "distill.max_steps=2", f"outputs={tmp_path}/out",
                           cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run] = [p.parent for p in (tmp_path / "out").glob("distill/*/COMPLETE")]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"] == {"generate": str(main), "extra_generate": [str(extra), str(again)]}
    first, second = manifest["extra_generate"]
    assert (first["examples"], first["dropped_held_out"], first["dropped_repeats"]) == (4 - leaks, leaks, 0)
    assert (second["examples"], second["dropped_held_out"], second["dropped_repeats"]) == (0, leaks, 4 - leaks)
    assert manifest["num_train_examples"] + manifest["num_val_examples"] == len(trained) + 4 - leaks
    assert ("held out for evaluation" in proc.stdout + proc.stderr) == bool(leaks)  # hydra logs to stdout

    # evaluate still measures on the main run's held-out prompts
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"inputs.distill={run}", "evaluate.hf_assisted=false",
                           "evaluate.baseline=false", f"outputs={tmp_path}/eval", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report] = list((tmp_path / "eval").glob("evaluate/*/report.json"))
    assert json.loads(report.read_text())["prompt_ids"] == [p["id"] for p in held_out]

    # the same run twice, or a folder that is not a finished generate run: refused before any model loads
    for extra_list, says in ((f"[{extra},{extra}]", "twice"), (f"[{main}]", "which is inputs.generate"),
                             (f"[{run}]", "inputs.extra_generate=<a generate run folder>")):
        proc = cli_in_process("distill", "experiment=tiny", f"inputs.generate={main}",
                              f"inputs.extra_generate={extra_list}", f"outputs={tmp_path}/bad", cwd=root)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-800:]


def test_extra_generate_runs_with_another_top_k_are_cut_to_the_smaller_k(tmp_path):
    from distill.data.generated import load_generated
    from distill.data.training_data import training_examples
    from distill.models.loading import load_model

    runs = {}
    for k, text in ((4, "apples"), (2, "pears")):
        prompts = _prompt_file(tmp_path / f"{text}.jsonl", [
            {"id": f"{text}-{i}", "messages": [{"role": "user", "content": f"a poem about {text}, {i}"}]}
            for i in range(3)])
        proc = draftsmith_tiny("generate", "experiment=tiny", "data=file", f"data.path={prompts}",
                               "generate.num_prompts=2", "evaluate.num_prompts=1", f"generate.store_top_k={k}",
                               f"outputs={tmp_path}/{text}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [runs[k]] = [p.parent for p in (tmp_path / text).glob("generate/*/COMPLETE")]
    dataset, held_out, _ = load_generated(runs[4])
    _, tokenizer, _ = load_model("tiny-target")
    columns = ["prompt_ids", "completion_ids", "top_k_ids", "top_k_logprobs"]
    examples, [added] = training_examples(dataset, held_out, [runs[2]], tokenizer, columns)
    assert len(examples) == 4 and added["store_top_k"] == 2
    assert all(len(row) == 2 for ex in examples for row in ex["top_k_ids"] + ex["top_k_logprobs"])
    # the cut keeps each position's two most likely tokens (the stored lists are sorted)
    first = dataset[0]
    assert examples[0]["top_k_ids"] == [row[:2] for row in first["top_k_ids"]]
    assert examples[0]["top_k_logprobs"] == [row[:2] for row in first["top_k_logprobs"]]


def test_pipeline_refuses_an_extra_generate_run_without_stored_log_probs(tiny_run, tmp_path):
    root, pipeline = tiny_run
    main = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"  # stored nothing
    proc = cli_in_process("pipeline", "experiment=tiny", "distill.target_source=stored", "generate.store_top_k=4",
                          f"inputs.extra_generate=[{main}]", f"outputs={tmp_path}/outputs", cwd=root)
    assert proc.returncode == 2 and "generate.store_top_k=20" in proc.stderr, proc.stderr[-800:]
    assert "[1/4]" not in proc.stdout


def test_max_prompt_tokens_passes_over_long_prompts(tmp_path):
    from distill.data.prompts import Prompt, encode_prompt
    from distill.models.loading import load_model

    _, tokenizer, _ = load_model("tiny-target")
    texts = [f"short prompt {i}" for i in range(6)] + [f"a long prompt {i} " + "word " * 100 for i in range(3)]
    lengths = [len(encode_prompt(tokenizer, Prompt(id="x", source="file", category="file",
                                                   messages=[{"role": "user", "content": t}]))) for t in texts]
    limit = max(lengths[:6])
    assert min(lengths[6:]) > limit
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(t + "\n" for t in texts))
    args = ["generate", "experiment=tiny", "data=file", f"data.path={prompts}", f"outputs={tmp_path}/outputs",
            "evaluate.num_prompts=1", f"data.max_prompt_tokens={limit}"]
    proc = draftsmith_tiny(*args, "generate.num_prompts=5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import datasets

    [run] = [p.parent for p in (tmp_path / "outputs").glob("generate/*/COMPLETE")]
    rows = datasets.load_from_disk(str(run / "dataset"))
    assert len(rows) == 5 and max(len(ids) for ids in rows["prompt_ids"]) <= limit
    passed_over = json.loads((run / "manifest.json").read_text())["prompts_over_max_tokens"]
    assert 0 <= passed_over <= 3 and (f"passed over {passed_over} prompt(s)" in proc.stdout) == (passed_over > 0)
    # six prompts are short enough: asking for seven is refused before the target loads, naming the key
    proc = cli_in_process(*args, "generate.num_prompts=6", cwd=tmp_path)
    assert proc.returncode == 2 and "data.max_prompt_tokens" in proc.stderr, proc.stderr[-800:]


def test_export_finds_the_evaluation_of_its_drafter_among_newer_ones(tiny_run, tmp_path):
    root, pipeline = tiny_run
    run = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent
    out = tmp_path / "outputs"
    assert draftsmith_tiny("distill", "experiment=tiny", f"inputs.generate={run / 'generate'}", "distill.max_steps=1",
                           f"outputs={out}", cwd=root).returncode == 0
    [mine] = [p.parent for p in out.glob("distill/*/COMPLETE")]
    for distill_run in (mine, run / "distill"):  # this drafter's evaluation, then a newer one of another drafter
        proc = draftsmith_tiny("evaluate", "experiment=tiny", f"inputs.distill={distill_run}",
                               "evaluate.hf_assisted=false", f"outputs={out}", cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = draftsmith_tiny("export", "experiment=tiny", f"inputs.distill={mine}", f"outputs={out}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [export] = [p.parent for p in out.glob("export/*/COMPLETE")]
    used = Path(json.loads((export / "manifest.json").read_text())["inputs"]["evaluate"])
    assert json.loads((used / "manifest.json").read_text())["inputs"]["distill"] == str(mine)


def test_distill_refuses_data_of_another_target_before_making_a_run_folder(tiny_run, tmp_path):
    root, pipeline = tiny_run
    gen = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    proc = cli_in_process("distill", "experiment=tiny", "target.name=tiny-drafter", f"inputs.generate={gen}",
                          f"outputs={tmp_path}/out", cwd=root)
    assert proc.returncode == 2 and "not by target 'tiny-drafter'" in proc.stderr, proc.stderr[-1000:]
    assert not (tmp_path / "out" / "distill").exists() or not any((tmp_path / "out" / "distill").iterdir())


def test_a_pipeline_folder_given_as_a_stage_input_names_its_stage_folder(tiny_run, tmp_path):
    root, pipeline = tiny_run
    folder = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent
    proc = cli_in_process("evaluate", "experiment=tiny", f"inputs.distill={folder}", f"outputs={tmp_path}", cwd=root)
    assert proc.returncode == 2 and f"inputs.distill={folder / 'distill'}" in proc.stderr, proc.stderr[-1000:]


def test_pipeline_run_again_reuses_its_finished_distill_stage(tmp_path):
    """A pipeline killed after distill finished (say, in evaluate): the same command again does not retrain."""
    # a pipeline of its own: a copy of the module's outputs would not do, the data's identity (generate's
    # manifest) names the outputs folder its shards are in
    first = draftsmith_tiny("pipeline", "experiment=tiny", f"outputs={tmp_path}/outputs", "evaluate.hf_assisted=false",
                            cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    trained = Path(first.stdout.strip().splitlines()[-1]).parent.parent / "distill"
    again = draftsmith_tiny("pipeline", "experiment=tiny", f"outputs={tmp_path}/outputs", "evaluate.hf_assisted=false",
                            cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"distill: {trained} already trained" in again.stdout
    report_path = Path(again.stdout.strip().splitlines()[-1])
    report = json.loads(report_path.read_text())
    assert report["drafter"]["path"] == str(trained / "drafter") and report["stages"]["distill"]["reused"] == str(trained)
    assert f"distill (reused: {trained}, not trained again)" in report_path.with_name("report.md").read_text()
    # other settings, or distill.resume=never, train anew
    other = draftsmith_tiny("pipeline", "experiment=tiny", f"outputs={tmp_path}/outputs", "evaluate.hf_assisted=false",
                            "distill.max_steps=9", cwd=tmp_path)
    assert other.returncode == 0 and "already trained" not in other.stdout, other.stderr[-2000:]


def test_pipeline_reads_given_generate_and_distill_runs_instead_of_redoing_them(tiny_run, tmp_path):
    root, pipeline = tiny_run
    first = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent
    out = tmp_path / "outputs"
    # inputs.generate as a relative path: recorded absolute
    proc = draftsmith_tiny("pipeline", "experiment=tiny", f"inputs.generate={first.relative_to(root) / 'generate'}",
                           f"outputs={out}", "evaluate.hf_assisted=false", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"[1/4] generate: using {first / 'generate'}" in proc.stdout
    [run] = list((out / "pipeline").iterdir())
    assert not (run / "generate").exists() and (run / "distill" / "COMPLETE").is_file()
    report = json.loads((run / "evaluate" / "report.json").read_text())
    assert report["stages"]["generate"]["given"] == str(first / "generate")
    assert "distill" in report["stages"] and "given" not in report["stages"]["distill"]

    # a given distill run brings its own generate run: neither stage runs
    proc = draftsmith_tiny("pipeline", "experiment=tiny", f"inputs.distill={run / 'distill'}", f"outputs={out}",
                           "evaluate.hf_assisted=false", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"[1/4] generate: using {first / 'generate'}" in proc.stdout
    assert f"[2/4] distill: using {run / 'distill'}" in proc.stdout
    report = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    assert report["drafter"]["path"] == str(run / "distill" / "drafter")

    proc = cli_in_process("pipeline", "experiment=tiny", f"inputs.evaluate={run / 'evaluate'}", f"outputs={out}",
                          cwd=root)
    assert proc.returncode == 2 and "drop it" in proc.stderr, proc.stderr[-1000:]
    proc = cli_in_process("pipeline", "experiment=tiny", f"inputs.generate={tmp_path / 'nowhere'}", f"outputs={out}",
                          cwd=root)
    assert proc.returncode == 2 and "inputs.generate=" in proc.stderr, proc.stderr[-1000:]


def test_distill_again_with_the_same_data_and_settings_does_not_train_again(tiny_run, tmp_path):
    root, pipeline = tiny_run
    gen = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    args = ("distill", "experiment=tiny", f"inputs.generate={gen}", "distill.max_steps=1", f"outputs={tmp_path}")
    assert draftsmith_tiny(*args, cwd=root).returncode == 0
    [trained] = [p.parent for p in tmp_path.glob("distill/*/COMPLETE")]
    again = draftsmith_tiny(*args, cwd=root)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"distill: {trained} already trained" in again.stdout
    assert list((tmp_path / "distill").iterdir()) == [trained]  # and no empty run folder
    assert draftsmith_tiny(*args, "distill.resume=never", cwd=root).returncode == 0
    assert len(list(tmp_path.glob("distill/*/COMPLETE"))) == 2

    # a sweep run again: each job folder names the finished run it found, and evaluate reads that folder
    sweep = ("distill", "-m", "experiment=tiny", f"inputs.generate={gen}", "distill.max_steps=1", "distill.lr=1e-3,2e-3",
             f"outputs={tmp_path}/sweeps")
    assert draftsmith_tiny(*sweep, cwd=root).returncode == 0
    again = draftsmith_tiny(*sweep, cwd=root)
    assert again.returncode == 0 and again.stdout.count("already trained") == 2, again.stderr[-2000:]
    first_sweep, second_sweep = sorted((tmp_path / "sweeps" / "multirun" / "distill").iterdir())
    job = next(second_sweep.glob("0_*"))
    assert json.loads((job / "reused.json").read_text()) == {"distill_run": str(next(first_sweep.glob("0_*")))}
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"inputs.distill={job}", "evaluate.hf_assisted=false",
                           "evaluate.baseline=false", f"outputs={tmp_path}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())["drafter"]["path"] == str(
        next(first_sweep.glob("0_*")) / "drafter")


def test_held_out_prompts_of_another_generate_run_are_checked_against_the_training_data(tiny_run, tmp_path):
    """inputs.generate=<another run> for evaluate: its held-out prompts may be this drafter's training prompts."""
    from datasets import load_from_disk

    from distill.data.prompts import load_prompts

    root, pipeline = tiny_run
    first = Path(pipeline.stdout.strip().splitlines()[-1]).parent.parent
    trained_ids = set(load_from_disk(str(first / "generate" / "dataset"))["prompt_id"])
    trained = [p for p in load_prompts("humaneval") if p.id in trained_ids]
    prompts = _prompt_file(tmp_path / "trained.jsonl", [{"id": p.id, "messages": p.messages} for p in trained])
    proc = draftsmith_tiny("generate", "experiment=tiny", "data=file", f"data.path={prompts}", "evaluate.num_prompts=2",
                           f"generate.num_prompts={len(trained) - 2}", f"outputs={tmp_path}/gen", cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [other] = [p.parent for p in (tmp_path / "gen").glob("generate/*/COMPLETE")]
    proc = draftsmith_tiny("evaluate", "experiment=tiny", f"inputs.distill={first / 'distill'}",
                           f"inputs.generate={other}", "evaluate.hf_assisted=false", f"outputs={tmp_path}/eval",
                           cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 of the 2 prompts" in proc.stdout
    [report_path] = list((tmp_path / "eval").glob("evaluate/*/report.json"))
    report = json.loads(report_path.read_text())
    assert report["eval_prompts"] == {"source": "held-out", "generate": str(other), "seen_in_training": 2}
    assert "**2 of them in the training data**" in (report_path.parent / "report.md").read_text()
    # the drafter's own generate run: nothing seen, and the report says plainly "held-out prompts"
    own = json.loads((first / "evaluate" / "report.json").read_text())
    assert own["eval_prompts"] == {"source": "held-out", "seen_in_training": 0}


def test_a_damaged_file_in_a_finished_run_is_named_with_the_command_that_writes_it_again(tiny_run, tmp_path):
    """A cut .arrow or model.safetensors in a COMPLETE run: the size check in the manifest catches it before any
    loading, and the message gives the run, the file and the command line that made the run."""
    import shutil

    from distill.errors import DamagedRunError
    from distill.runs import require_complete

    root, proc = tiny_run
    copy = tmp_path / "pipeline"
    shutil.copytree(Path(proc.stdout.strip().splitlines()[-1]).parent.parent, copy)
    assert require_complete(copy / "generate", "generate") == copy / "generate"  # intact: accepted
    [arrow] = (copy / "generate" / "dataset").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:100])
    with pytest.raises(DamagedRunError, match=r"generate run .* is damaged: dataset/.*\.arrow is 100 bytes where "
                                              r"the run wrote .*`draftsmith pipeline experiment=tiny outputs="):
        require_complete(copy / "generate", "generate")
    weights = copy / "distill" / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for stage in ("evaluate", "export"):
        refused = cli_in_process(stage, "experiment=tiny", f"inputs.distill={copy / 'distill'}",
                                 f"outputs={tmp_path / 'out'}", cwd=tmp_path)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert "drafter/model.safetensors is 1000 bytes" in refused.stderr and "is damaged" in refused.stderr


def test_generate_answers_the_held_out_prompts_and_evaluate_reads_them(tiny_run):
    """The target's held-out answers are written once by generate (listed in its manifest with their size)
    and read by evaluate: a sweep's evaluates then pay only for their drafters' passes."""
    root, proc = tiny_run
    generate = Path(proc.stdout.strip().splitlines()[-1]).parent.parent / "generate"
    manifest = json.loads((generate / "manifest.json").read_text())
    answers_file = generate / manifest["held_out_answers"]["file"]
    answers = json.loads(answers_file.read_text())
    assert len(answers) == 3 and all(1 <= len(a) <= 24 for a in answers)  # evaluate.num_prompts, decode.max_new_tokens
    assert manifest["file_sizes"][answers_file.name] == answers_file.stat().st_size
    assert f"answers to these 3 prompts come from {answers_file}" in proc.stdout


def test_evaluate_with_other_batch_settings_reads_the_generate_runs_answers(tiny_run, tmp_path):
    """generate.batch_size is part of the answers' key (batching changes the rounding), but evaluate looks up the
    generate run's answers under that run's own batching too: another batch size at evaluate time used to answer
    all held-out prompts again (10 minutes for 256 prompts on the real pair)."""
    root, proc = tiny_run
    pipeline = Path(proc.stdout.strip().splitlines()[-1]).parent.parent
    generate = pipeline / "generate"
    answers_file = generate / json.loads((generate / "manifest.json").read_text())["held_out_answers"]["file"]
    again = cli_in_process("evaluate", "experiment=tiny", f"inputs.distill={pipeline / 'distill'}",
                           "generate.batch_size=2", "generate.batch_tokens=999", "evaluate.timed_prompts=1",
                           f"outputs={tmp_path / 'out'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"answers to these 3 prompts come from {answers_file}" in again.stdout
    assert not list((tmp_path / "out" / ".shards").glob("answers-*.json"))  # nothing answered anew


def test_recorded_batching_reads_a_run_folders_config(tmp_path):
    from distill.measure.simulation import recorded_batching

    assert recorded_batching(tmp_path) == []  # no config.yaml
    (tmp_path / "config.yaml").write_text("stage: generate\ngenerate:\n  batch_size: 32\n  batch_tokens: 6144\n")
    assert recorded_batching(tmp_path) == [(32, 6144)]
    (tmp_path / "config.yaml").write_text("stage: distill\n")
    assert recorded_batching(tmp_path) == []


def _pipeline_copy(proc: subprocess.CompletedProcess, to: Path) -> Path:
    """A copy of the finished tiny pipeline (times kept) whose files a test may change."""
    shutil.copytree(Path(proc.stdout.strip().splitlines()[-1]).parent.parent, to)
    return to


def _refused(proc: subprocess.CompletedProcess, *phrases: str) -> None:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(phrase in proc.stderr for phrase in phrases), proc.stderr[-2000:]


def test_export_never_replaces_another_export_runs_drafter(tiny_run, tmp_path):
    """Issue 37 case 1: overwriting a finished export run's drafter-hf with another drafter left a COMPLETE run whose
    manifest and card named the first one."""
    root, proc = tiny_run
    run = _pipeline_copy(proc, tmp_path / "fkl")
    exported = run / "export" / "drafter-hf"
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    refused = cli_in_process("export", "experiment=tiny", f"inputs.distill={run / 'distill'}",
                             f"export.path={exported}", "export.overwrite=true", f"outputs={tmp_path / 'out'}", cwd=root)
    _refused(refused, f"{exported} is inside the export run {run / 'export'}", "choose another export.path")
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before


def test_export_path_links_are_resolved_and_checked_before_any_work(tiny_run, tmp_path):
    """Issue 37 case 6: a link loop failed after the export was built; a link to a run's drafter folder was saved
    only by Python refusing to rmtree a link, leaving a full ``<path>.new`` that blocked the next attempt."""
    root, proc = tiny_run
    run = _pipeline_copy(proc, tmp_path / "run")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    refused = cli_in_process("export", "experiment=tiny", f"inputs.distill={run / 'distill'}", f"export.path={loop}",
                             f"outputs={tmp_path / 'out'}", cwd=root)
    _refused(refused, f"export.path={loop} cannot be followed", "symbolic link loop")
    to_drafter = tmp_path / "to_drafter"
    to_drafter.symlink_to(run / "distill" / "drafter")
    before = {p.name: p.read_bytes() for p in (run / "distill" / "drafter").iterdir()}
    refused = cli_in_process("export", "experiment=tiny", f"inputs.distill={run / 'distill'}", "export.overwrite=true",
                             f"export.path={to_drafter}", f"outputs={tmp_path / 'out'}", cwd=root)
    _refused(refused, "is inside the distill run")
    assert {p.name: p.read_bytes() for p in (run / "distill" / "drafter").iterdir()} == before
    # a link to an earlier export outside any run: the folder it points to is replaced whole, nothing left beside it
    shared = tmp_path / "shared"
    shutil.copytree(run / "export" / "drafter-hf", shared / "drafter")
    (tmp_path / "latest").symlink_to(shared / "drafter")
    (shared / "drafter" / "README.md").write_text("the old card")
    done = draftsmith_tiny("export", "experiment=tiny", f"inputs.distill={run / 'distill'}", "export.overwrite=true",
                           f"export.path={tmp_path / 'latest'}", f"outputs={tmp_path / 'out'}", cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "latest").is_symlink() and sorted(p.name for p in shared.iterdir()) == ["drafter"]
    assert "Draft model for" in (shared / "drafter" / "README.md").read_text()


def test_a_damaged_manifest_is_named_and_no_older_run_is_taken_in_its_place(tiny_run, tmp_path):
    """Issue 37 cases 2 and 5: a cut manifest.json gave a JSONDecodeError traceback when named, and with no input
    named the older run was exported without a word."""
    root, proc = tiny_run
    out = tmp_path / "outputs"
    old = _pipeline_copy(proc, out / "old")
    new = _pipeline_copy(proc, out / "new")
    for marker in new.glob("*/COMPLETE"):
        marker.touch()  # the newer run
    manifest = new / "distill" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    for stage in ("evaluate", "export"):
        refused = cli_in_process(stage, "experiment=tiny", f"outputs={out}", cwd=root)
        _refused(refused, f"run {new / 'distill'} is damaged: manifest.json cannot be read",
                 "`draftsmith pipeline experiment=tiny", f"the newest intact one is {old / 'distill'}")
        named = cli_in_process(stage, "experiment=tiny", f"inputs.distill={new / 'distill'}", f"outputs={out}",
                               cwd=root)
        _refused(named, f"run {new / 'distill'} is damaged: manifest.json cannot be read",
                 "pass inputs.distill=<another finished distill run>")
    assert not list(out.glob("export/*"))
    (new / "generate" / "manifest.json").write_text("")
    refused = cli_in_process("distill", "experiment=tiny", f"outputs={out}", cwd=root)
    _refused(refused, f"run {new / 'generate'} is damaged: manifest.json is empty")


def test_export_refuses_a_damaged_evaluation_instead_of_dropping_it_from_the_card(tiny_run, tmp_path):
    """Issue 37 case 4: with the evaluate run's manifest emptied, the card said "No evaluation report was found"."""
    root, proc = tiny_run
    from distill.runs import require_complete

    run = _pipeline_copy(proc, tmp_path / "outputs" / "run")
    # intact: the pipeline's additions to its report.json are recorded, not taken for damage
    assert require_complete(run / "evaluate", "evaluate") == run / "evaluate"
    (run / "evaluate" / "manifest.json").write_text("")
    refused = cli_in_process("export", "experiment=tiny", f"inputs.distill={run / 'distill'}",
                             f"outputs={tmp_path / 'outputs'}", cwd=root)
    _refused(refused, f"run {run / 'evaluate'} is damaged: manifest.json is empty", "inputs.evaluate=")
    assert not list((tmp_path / "outputs").glob("export/*/drafter-hf"))


def test_a_logger_that_fails_at_finish_never_loses_a_finished_stage(tiny_run, tmp_path, monkeypatch):
    """Issue 37 case 10: wandb online lost its network; its timeout at finish (a CommError) ended the stage with a
    traceback before COMPLETE was written, although the stage's outputs were whole."""
    import wandb

    class LostNetwork:
        summary: dict = {}
        dir = str(tmp_path / "wandb" / "run-1" / "files")

        def log(self, *args, **kwargs):
            pass

        def finish(self):
            raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: LostNetwork())
    root, proc = tiny_run
    run = _pipeline_copy(proc, tmp_path / "run")
    done = cli_in_process("export", "experiment=tiny", "logger=wandb", f"inputs.distill={run / 'distill'}",
                          f"outputs={tmp_path / 'out'}", cwd=root)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "warning: wandb could not finish (CommError: Run initialization has timed out" in done.stderr
    assert f"`wandb sync {tmp_path / 'wandb' / 'run-1'}`" in done.stderr
    [export] = list((tmp_path / "out").glob("export/*"))
    assert (export / COMPLETE).is_file() and (export / "drafter-hf" / "config.json").is_file()


def test_a_disk_that_fills_up_while_evaluate_draws_its_plots_ends_with_one_line(tiny_run, tmp_path, monkeypatch):
    """Issue 37 case 7: with room for report.json but not for the PNGs, evaluate ended with matplotlib's
    ``OSError: [Errno 28]`` traceback; it gives the disk-full line, and the measured report.json stays."""
    import errno

    import matplotlib.figure

    def full_for_images(target: str | Path) -> None:
        if str(target).endswith(".png"):
            raise OSError(errno.ENOSPC, "No space left on device")

    draw, rename = matplotlib.figure.Figure.savefig, os.replace

    def savefig(self, fname, *args, **kwargs):  # matplotlib writing the file itself
        full_for_images(fname if isinstance(fname, (str, Path)) else getattr(fname, "name", ""))
        return draw(self, fname, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):  # an atomic write publishing it
        full_for_images(dst)
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    monkeypatch.setattr("distill.files.os.replace", replace)
    root, proc = tiny_run
    run = _pipeline_copy(proc, tmp_path / "run")
    out = tmp_path / "out"
    failed = cli_in_process("evaluate", "experiment=tiny", f"inputs.distill={run / 'distill'}",
                            "evaluate.hf_assisted=false", f"outputs={out}", cwd=root)
    _refused(failed, "the disk filled up while writing", ".png", "run the same command again")
    [evaluate] = list(out.glob("evaluate/*"))
    report = json.loads((evaluate / "report.json").read_text())
    assert report["acceptance_rate"] is not None and not (evaluate / COMPLETE).exists()
    assert not list(evaluate.glob("*.png")) and not list(evaluate.glob(".*.tmp"))


def test_a_complete_marker_outside_any_run_folder_is_not_taken_for_a_damaged_run(tmp_path):
    """find_latest refuses only for a damaged run of the stage asked for: a stray COMPLETE (no manifest, no
    config.yaml) or a damaged run of another stage is passed over."""
    from distill.errors import DamagedRunError, IncompleteRunError
    from distill.runs import find_latest

    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / COMPLETE).write_text("")
    other = tmp_path / "generate" / "run"
    other.mkdir(parents=True)
    (other / "config.yaml").write_text("stage: generate\n")
    (other / "manifest.json").write_text("{")
    (other / COMPLETE).write_text("")
    with pytest.raises(IncompleteRunError, match="no finished distill run") as refused:
        find_latest(tmp_path, "distill")
    assert not isinstance(refused.value, DamagedRunError)
    with pytest.raises(DamagedRunError, match=r"generate/run is damaged: manifest.json cannot be read"):
        find_latest(tmp_path, "generate")
