"""``draftsmith check``: the pre-flight measurements, on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distill.errors import ConfigError, TokenizerMismatchError
from distill.runs import COMPLETE
from distill.stages import check as check_module
from tests.distill.test_config import _compose
from tests.distill.stages.test_pipeline import draftsmith_tiny
from tests.decode.test_speculative import PROMPTS, tiny_model


def test_check_through_the_cli(tmp_path):
    proc = draftsmith_tiny("check", "experiment=tiny", "check.num_prompts=2", "check.draft_length=3",
                           f"outputs={tmp_path}/outputs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.name == "check.json" and (path.parent / COMPLETE).is_file()
    result = json.loads(path.read_text())
    assert result["tokenizers_compatible"] is True and result["num_prompts"] == 2
    assert 0.0 <= result["top1_agreement"] <= 1.0 and result["accuracy_pass"] == (result["top1_agreement"] >= 0.7)
    assert 0.0 <= result["acceptance_rate"] <= 1.0 and result["cost_ratio"] > 0
    choice = result["draft_length_choice"]
    assert 1 <= choice["best_draft_length"] <= 8 and choice["rule_of_thumb"] >= 2
    assert set(choice["expected_speedup_by_k"]) == {str(k) for k in range(1, 9)}
    # the recommended K comes from tau simulated exactly at every K, with the measured costs
    simulated = result["simulated"]
    assert set(simulated["per_k"]) == {str(k) for k in range(1, 9)} and simulated["num_prompts"] == 2
    assert choice["best_draft_length"] == simulated["recommended_draft_length"]
    assert simulated["per_k"]["3"]["mean_accepted_tokens"] == pytest.approx(simulated["mean_accepted_tokens"])
    assert result["verdict"]
    assert "**Verdict:**" in (path.parent / "check.md").read_text()


def test_check_records_what_differs_and_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(check_module, "tokenizers_compatible", lambda a, b: (False, "eos differs: 'x' vs 'y'"))
    cfg = _compose("experiment=tiny")
    with pytest.raises(TokenizerMismatchError, match="eos differs"):
        check_module.run_check(cfg, tmp_path)
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["tokenizers_compatible"] is False and "eos differs" in result["tokenizer_detail"]
    assert not (tmp_path / COMPLETE).exists()


def test_too_few_prompts_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(check_module, "load_model", no_load)
    cfg = _compose("experiment=tiny", "check.num_prompts=100000")
    with pytest.raises(ConfigError, match=r"lower the counts \(check.num_prompts\)"):
        check_module.run_check(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_top1_agreement():
    target, other = tiny_model(2, seed=0), tiny_model(1, seed=1)
    assert check_module.top1_agreement(target, target, PROMPTS, 4) == 1.0
    value = check_module.top1_agreement(target, other, PROMPTS, 4)
    assert 0.0 <= value < 1.0
    # by hand: position-wise agreement of the two models' own greedy continuations
    from decode.speculative import target_generate

    agree = 0
    for p in PROMPTS:
        a = target_generate(target, torch.tensor([p]), max_new_tokens=4, eos_token_ids=[]).new_tokens
        b = target_generate(other, torch.tensor([p]), max_new_tokens=4, eos_token_ids=[]).new_tokens
        agree += int((a == b).sum())
    assert value == agree / (4 * len(PROMPTS))
