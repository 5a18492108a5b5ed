"""decode.engines.vllm_engine with the real vLLM, on the tiny CLI models (needs vLLM installed; minutes)."""

from __future__ import annotations

import pytest

from decode.engines.vllm_engine import run_instance
from distill.models.loading import resolve_model

pytestmark = [pytest.mark.extra, pytest.mark.slow]


def test_the_target_alone_and_with_a_drafter_decode_the_same_tokens():
    pytest.importorskip("vllm")
    target, drafter = resolve_model("tiny-target").path, resolve_model("tiny-drafter").path
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
