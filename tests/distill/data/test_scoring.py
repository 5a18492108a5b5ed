"""generate.answers=dataset: the target scores answers that exist, and its rows equal generate's."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_from_disk
from tiny_models import tiny_qwen2

from decode.teacher_forcing import answer_top_k
from distill.config import GenerateConfig
from distill.data.prompts import Prompt, load_prompts
from distill.data.scoring import encode_answer, require_answers, score_batch
from distill.errors import ConfigError, PromptError
from distill.models.tiny import tiny_tokenizer
from distill.stages.generate import answer_batch
from tests.distill.stages.test_pipeline import draftsmith_tiny

VOCAB = 61
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(4, 0, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=VOCAB - 1)


def test_scoring_the_targets_own_answers_gives_what_generate_stored(target):
    """The target's greedy answers, scored in one teacher-forced batch, give the top-k ids and log-probs that
    generate kept while writing them: the two sources of the same rows agree."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 8, 5, 6)]
    written = answer_batch(target, prompts, pad_id=0, eos_ids=[VOCAB - 1], max_new_tokens=10, temperature=0.0,
                           top_p=1.0, store_top_k=6)
    scored = score_batch(target, prompts, [(w["completion_ids"], w["finish_reason"]) for w in written], store_top_k=6)
    for w, s in zip(written, scored):
        assert s["completion_ids"] == w["completion_ids"] and s["finish_reason"] == w["finish_reason"]
        assert s["top_k_ids"] == w["top_k_ids"]
        torch.testing.assert_close(torch.tensor(s["top_k_logprobs"]), torch.tensor(w["top_k_logprobs"]),
                                   atol=1e-4, rtol=1e-4)


def test_answer_top_k_is_the_full_forward_at_answer_positions(target):
    prompt, answer = [4, 9, 2], [7, 7, 30, 1]
    ids, logprobs = answer_top_k(target, [prompt], [answer], 3)[0]
    with torch.no_grad():
        full = torch.log_softmax(target(torch.tensor([prompt + answer])).logits[0].float(), -1)
    expected = full[len(prompt) - 1:len(prompt) - 1 + len(answer)].topk(3, dim=-1)
    assert ids.shape == (4, 3) and torch.equal(ids, expected.indices)
    torch.testing.assert_close(logprobs, expected.values, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="k="):
        answer_top_k(target, [prompt], [answer], VOCAB + 1)


def test_packed_scoring_equals_padded_scoring(target):
    """Sequences laid end to end (position ids restarting, no mask) score as they do padded: same top-k ids and
    log-probs per answer position, in input order, whatever the layout."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 9, 5, 2, 7)]
    answers = [torch.randint(1, VOCAB - 1, (int(n),), generator=g).tolist() for n in (4, 1, 6, 3, 5)]
    padded = answer_top_k(target, prompts, answers, 5)
    for layout in ([[1, 0], [2, 3], [4]], [[4, 3, 2, 1, 0]]):
        packed = answer_top_k(target, prompts, answers, 5, packed_rows=layout)
        for (ids, lp), (pids, plp) in zip(padded, packed):
            assert torch.equal(ids, pids)
            torch.testing.assert_close(plp, lp, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows must hold each of the 5 sequences once"):
        answer_top_k(target, prompts, answers, 5, packed_rows=[[0, 1], [2, 3]])
    rows = score_batch(target, prompts, [(a, "length") for a in answers], store_top_k=5)  # packs: the target allows
    assert target._draftsmith_packs_apart is True
    assert [r["top_k_ids"] for r in rows] == [ids.tolist() for ids, _ in padded]


def test_without_stored_top_k_scoring_runs_no_forward():
    class NoModel:
        def __call__(self, *args, **kwargs):
            raise AssertionError("no forward expected")

    rows = score_batch(NoModel(), [[1, 2]], [([5, 6], "eos")], store_top_k=0)
    assert rows == [{"completion_ids": [5, 6], "finish_reason": "eos"}]


def test_an_answer_is_encoded_as_the_template_renders_the_assistant_turn():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = Prompt("file/a", "file", "file", [{"role": "user", "content": "hi"}], answer="hello there")
    ids, reason = encode_answer(tokenizer, prompt, [eos], max_tokens=100)
    assert reason == "eos" and ids[-1] == eos and tokenizer.decode(ids[:-1]) == "hello there"
    cut, reason = encode_answer(tokenizer, prompt, [eos], max_tokens=4)
    assert cut == ids[:4] and reason == "length"
    with pytest.raises(PromptError, match="no answer"):
        encode_answer(tokenizer, Prompt("file/b", "file", "file", prompt.messages), [eos], 10)


def test_prompts_without_answers_are_refused_before_work():
    prompts = [Prompt("humaneval/1", "humaneval", "code", [{"role": "user", "content": "x"}]),
               Prompt("sharegpt/1", "sharegpt", "chat", [{"role": "user", "content": "y"}], answer="z")]
    with pytest.raises(PromptError, match=r"1 of 2 training prompts carry no answer .*humaneval.*generate.answers=target"):
        require_answers(prompts)
    with pytest.raises(ConfigError, match="generate.answers"):
        GenerateConfig(answers="mine")


def test_a_file_gives_answers_as_a_key_or_a_closing_assistant_turn(tmp_path):
    path = tmp_path / "logs.jsonl"
    lines = [{"prompt": "a?", "answer": "A."},
             {"messages": [{"role": "user", "content": "b?"}, {"role": "assistant", "content": "B."}]},
             {"prompt": "c?"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompts = load_prompts("file", str(path))
    assert [p.answer for p in prompts] == ["A.", "B.", None]
    assert prompts[1].messages == [{"role": "user", "content": "b?"}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "b?"}, {"role": "assistant", "content": "B"}],
                                "answer": "C"}) + "\n")
    with pytest.raises(PromptError, match="not both"):
        load_prompts("file", str(path))


def test_sharegpt_prompts_carry_the_reply_that_followed():
    prompts = load_prompts("sharegpt", limit=50)
    assert sum(p.answer is not None for p in prompts) >= 40
    assert all(p.answer is None or p.answer.strip() for p in prompts)


def test_generate_scores_a_files_answers_through_the_cli(tmp_path):
    """A tiny generate with answers=dataset: the dataset holds the file's answers (as the template renders
    them) with the target's top-k, the manifest says who wrote them, and the held-out file holds no answers."""
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": f"question {i}?", "answer": f"answer number {i}."})
                            + "\n" for i in range(12)))
    common = ("generate", "experiment=tiny", "data=file", f"data.path={path}", "generate.answers=dataset",
              "generate.store_top_k=4", "evaluate.num_prompts=2")
    proc = draftsmith_tiny(*common, f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next((tmp_path / "out" / "generate").iterdir())
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["answers"] == "dataset" and manifest["processed_tokens_per_s"] > 0
    rows = load_from_disk(str(run / "dataset"))
    tokenizer = tiny_tokenizer()
    for row in rows:
        number = row["prompt_id"].split("/")[-1]
        assert tokenizer.decode(row["completion_ids"][:-1]) == f"answer number {number}."
        assert len(row["top_k_ids"]) == len(row["completion_ids"]) and len(row["top_k_ids"][0]) == 4
    assert all("answer" not in json.loads(line) for line in (run / "eval_prompts.jsonl").read_text().splitlines())
    # a prompt set without answers is refused in seconds, before the model loads
    proc = draftsmith_tiny("generate", "experiment=tiny", "generate.answers=dataset", f"outputs={tmp_path}/h",
                           cwd=tmp_path)
    assert proc.returncode == 2 and "carry no answer" in proc.stderr


@pytest.mark.extra  # a script's check: python -m pytest -m extra
def test_benchmark_stages_prints_each_stage_beside_its_bound(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(repo / "scripts" / "benchmark_stages.py"), "--target", "tiny-target",
                          "--drafter", "tiny-drafter", "--prompts", "3", "--max-new-tokens", "8", "--steps", "1",
                          "--bound-len", "32", "--max-prompt-tokens", "400", "--json"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    for stage in ("generate", "score", "distill"):
        figures = result[stage]
        assert set(figures) >= {"tokens_per_s", "answer_tokens_per_s", "bound_tokens_per_s", "ratio"}
        assert figures["ratio"] == pytest.approx(figures["tokens_per_s"] / figures["bound_tokens_per_s"], rel=1e-2)
        assert 0 < figures["answer_tokens_per_s"] < figures["tokens_per_s"]
    assert result["host"]["target_forward_tokens_per_s"] > 0 and result["distill"]["packing"] is True
    assert result["distill"]["recipe"] == "full_low_lr" and result["distill"]["method"] == "full"


def test_benchmark_stages_resolves_a_distill_recipe_as_the_pipeline_does():
    import importlib.util
    from pathlib import Path

    from distill.errors import DraftsmithError
    repo = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
    spec = importlib.util.spec_from_file_location("benchmark_stages", repo / "scripts" / "benchmark_stages.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from omegaconf import OmegaConf
    groups = OmegaConf.to_container(OmegaConf.load(repo / "conf" / "config.yaml").defaults)
    assert {"distill": script.DEFAULT_RECIPE} in groups  # the pipeline's recipe
    default = script.distill_recipe(script.DEFAULT_RECIPE)
    assert (default.method, default.batch_size, default.grad_accum, default.lr) == ("full", 2, 2, 2e-6)
    assert script.distill_recipe("lora").method == "lora"
    with pytest.raises(DraftsmithError, match="no .*nope.yaml; one of .*full_low_lr"):
        script.distill_recipe("nope")


def test_answers_auto_scores_only_where_every_training_prompt_comes_with_an_answer(capsys):
    from dataclasses import replace

    from distill.config import Config
    from distill.stages.generate import resolve_answers
    answered = [Prompt(f"sharegpt/{i}", "sharegpt", "chat", [{"role": "user", "content": f"q{i}"}], answer="a")
                for i in range(3)]
    bare = Prompt("humaneval/1", "humaneval", "code", [{"role": "user", "content": "x"}])
    cfg = Config()
    assert cfg.generate.answers == "auto"
    assert resolve_answers(cfg, answered) == "dataset"
    assert "scores the answers the 3 training prompts come with" in capsys.readouterr().out
    assert resolve_answers(cfg, [*answered, bare]) == "target"
    assert "3 of the 4 training prompts come with one" in capsys.readouterr().out
    assert resolve_answers(cfg, []) == "target"
    capsys.readouterr()
    asked = lambda answers: replace(cfg, generate=replace(cfg.generate, answers=answers))  # noqa: E731
    assert resolve_answers(asked("target"), answered) == "target" and not capsys.readouterr().out
    with pytest.raises(PromptError, match="1 of 4 training prompts carry no answer"):
        resolve_answers(asked("dataset"), [*answered, bare])
