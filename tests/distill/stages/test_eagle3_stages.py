"""drafter=eagle3 through the real CLI on the tiny models: distill trains a head, evaluate measures it beside the
stock drafter, export writes the speculators folder vLLM loads."""

from __future__ import annotations

import json

from distill.runs import COMPLETE
from tests.distill.stages.test_pipeline import draftsmith_tiny

HEAD = ("drafter=eagle3", "drafter.name=tiny-drafter", "drafter.draft_vocab_size=64")


def test_a_head_is_trained_measured_and_exported(tmp_path):
    out = f"outputs={tmp_path}/outputs"
    assert draftsmith_tiny("generate", "experiment=tiny", out, cwd=tmp_path).returncode == 0
    proc = draftsmith_tiny("distill", "experiment=tiny", out, *HEAD, "distill.max_steps=4", "distill.checkpoint_at=[2]",
                           cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (distill_dir,) = (tmp_path / "outputs" / "distill").iterdir()
    info = json.loads((distill_dir / "drafter" / "drafter_info.json").read_text())
    assert info["kind"] == "eagle3" and info["draft_vocab_size"] == 64 and (distill_dir / COMPLETE).is_file()
    steps = (distill_dir / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps] == [1, 2, 3, 4]

    proc = draftsmith_tiny("evaluate", "experiment=tiny", out, *HEAD, f"inputs.distill={distill_dir}",
                           "evaluate.checkpoints=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (eval_dir,) = (tmp_path / "outputs" / "evaluate").iterdir()
    report = json.loads((eval_dir / "report.json").read_text())
    assert report["kind"] == "eagle3" and set(report["drafters"]) == {"eagle3", "checkpoint-2", "stock"}
    # the budget curve: the stock drafter at 0 tokens, the step-2 head, the final one; ratios against stock
    points = report["budget_curve"]["points"]
    assert [p["drafter"] for p in points] == ["stock drafter", "checkpoint-2", "final head"]
    assert 0 == points[0]["training_tokens"] < points[1]["training_tokens"] < points[2]["training_tokens"]
    assert points[0]["predicted_speedup_ratio_to_stock"]["ratio"] == 1.0
    assert points[2]["predicted_speedup_ratio_to_stock"] == {
        k: report["against_stock"]["predicted_speedup_ratio"][k] for k in ("ratio", "ci95")}
    assert "## Training budget" in (eval_dir / "report.md").read_text() and (eval_dir / "budget_curve.png").is_file()
    head = report["drafters"]["eagle3"]["simulated"]
    assert head["num_prompts"] == 3 and 1.0 <= head["mean_accepted_tokens"] and "per_category" in head
    assert "tau_difference" in report["against_stock"] and "predicted_speedup_ratio" in report["against_stock"]
    timed = report["timed"]
    assert timed["eagle3"]["outputs_equal_target"] == timed["num_prompts"] == timed["stock"]["outputs_equal_target"]
    assert report["simulation_check"]["blocks_equal"] == report["simulation_check"]["prompts"]
    assert "EAGLE-3 head against the stock drafter" in (eval_dir / "report.md").read_text()

    proc = draftsmith_tiny("export", "experiment=tiny", out, *HEAD, f"inputs.distill={distill_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (export_dir,) = (tmp_path / "outputs" / "export").iterdir()
    config = json.loads((export_dir / "drafter-hf" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 64
    assert config["transformer_layer_config"]["model_type"] == "llama"


def test_a_head_the_target_cannot_have_is_refused_before_any_run_folder(tmp_path):
    from tests.distill.test_config import cli_in_process

    proc = cli_in_process("distill", "experiment=tiny", f"outputs={tmp_path}/outputs", *HEAD,
                          "drafter.aux_layers=[0,1,9]", cwd=tmp_path)
    assert proc.returncode != 0 and "aux layers" in (proc.stderr + proc.stdout)
    assert not (tmp_path / "outputs" / "distill").exists()
