"""decode.engines.vllm_engine with the real vLLM on tiny random models (needs vLLM installed; minutes). Their
heads are 64 wide: vLLM's CPU attention refuses the CLI's tiny models (head_dim 16)."""

from __future__ import annotations

import pytest

from decode.engines.vllm_engine import run_instance
from distill.models.tiny import tiny_tokenizer
from tests.tiny_models import tiny_qwen2

pytestmark = [pytest.mark.extra, pytest.mark.slow]


def _saved(folder, num_layers: int, seed: int):
    tiny_qwen2(num_layers, seed, vocab_size=259, hidden_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_scale=20.0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_the_target_alone_and_with_a_drafter_decode_the_same_tokens(tmp_path):
    pytest.importorskip("vllm")
    target, drafter = _saved(tmp_path / "target", 2, 0), _saved(tmp_path / "drafter", 1, 1)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    base = {"dtype": "float32", "prompts": prompts, "max_new_tokens": 12}
    alone = run_instance({**base, "kind": "plain", "model": str(target), "costs": True, "verify_tokens": [1, 2, 4]})
    assert [len(o) for o in alone["outputs"]] == [12, 12] or alone["tokens"] >= 2
    assert alone["costs"]["target_step_s"] > 0 and set(map(int, alone["costs"]["verify_s"])) == {1, 2, 4}
    drafted = run_instance({**base, "kind": "speculative", "model": str(target), "drafter": str(drafter),
                            "draft_length": 3})
    assert drafted["outputs"] == alone["outputs"]  # greedy in float32: lossless in the engine too
    counters = drafted["counters"]
    assert 0 <= counters["spec_decode_num_accepted_tokens"] <= counters["spec_decode_num_draft_tokens"]
    assert counters["spec_decode_num_drafts"] >= 1


def test_an_exported_eagle3_head_runs_in_vllm_and_decodes_the_targets_tokens(tmp_path):
    """The speculators folder draftsmith's export writes loads in vLLM's eagle3 method; greedy output in
    float32 equals vLLM's target alone."""
    pytest.importorskip("vllm")
    import torch

    from decode.eagle3.head import Eagle3Config, Eagle3Head
    from distill.models.eagle3_export import export_head

    target = tiny_qwen2(4, 0, vocab_size=259, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_scale=20.0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=200,
                                               aux_layers=[0, 1, 2]), torch.arange(200))
    (tmp_path / "head").mkdir()
    export_head(head, tmp_path / "head", target_name=str(tmp_path / "target"), draft_length=3, dtype=torch.float32)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    base = {"dtype": "float32", "prompts": prompts, "max_new_tokens": 12, "model": str(tmp_path / "target")}
    alone = run_instance({**base, "kind": "plain"})
    drafted = run_instance({**base, "kind": "speculative", "method": "eagle3", "drafter": str(tmp_path / "head"),
                            "draft_length": 3})
    assert drafted["outputs"] == alone["outputs"]
    assert drafted["counters"]["spec_decode_num_drafts"] >= 1
