"""decode.engines.llama_cpp_engine against a real llama.cpp build (skipped without the tools), on the shipped 0.5B
as target and drafter (llama.cpp refuses the tiny models' tokenizer: it has no merges)."""

from __future__ import annotations

import os

import pytest

from decode.engines import llama_cpp_engine as llama
from distill.models.loading import shipped_gguf

pytestmark = [pytest.mark.extra, pytest.mark.real]


@pytest.fixture(scope="module")
def tools_and_models(tmp_path_factory, qwen05):
    tools = llama.find_tools()
    if tools is None:
        pytest.skip(f"llama.cpp's tools are not on PATH or in $LLAMA_CPP_BIN (build them: {llama.BUILD})")
    gguf = shipped_gguf("qwen2.5-coder-0.5b-instruct", tmp_path_factory.mktemp("llama") / "qwen05.gguf")
    return tools, {"target": gguf, "drafter": gguf}


def test_plain_speculative_and_bench_read_llama_cpps_own_figures(tools_and_models):
    tools, models = tools_and_models
    alone = llama.plain(tools, models["target"], "hello there", 16)
    assert alone["tokens"] >= 1 and alone["tokens_per_s"] > 0
    drafted = llama.speculative(tools, models["target"], models["drafter"], "hello there", 16, 3)
    assert 0 < drafted["accepted"] <= drafted["drafted"] and drafted["tokens_per_s"] > 0
    # both greedy, but not always the same text, even with the target drafting for itself: llama.cpp's batched
    # (K + 1)-token verification computes other logits than its one-token steps (docs/engines.md), so near-ties
    # flip. They agree until the first such tie.
    assert len(os.path.commonprefix([alone["text"], drafted["text"]])) >= 5
    costs = llama.bench(tools, models["target"], depth=16, new_tokens=[1, 4])
    assert costs["step_s"] > 0 and set(costs["forward_s"]) == {1, 4}
    assert llama.version(tools).startswith("llama.cpp ")


def test_a_failing_tool_says_which_and_why(tools_and_models, tmp_path):
    tools, _ = tools_and_models
    missing = tmp_path / "missing.gguf"
    with pytest.raises(RuntimeError, match="llama-completion failed with exit code"):
        llama.plain(tools, missing, "hello", 4)
