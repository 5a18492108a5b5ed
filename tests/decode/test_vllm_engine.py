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
