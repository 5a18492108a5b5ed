"""Where the target's distributions come from: stored top-k log-probs, and on-policy (GKD) data."""

from __future__ import annotations

import json
import math

import pytest
import torch
from loop_settings import loop_settings
from tiny_models import tiny_qwen2
from transformers import Qwen2ForCausalLM

from distill.config import DistillConfig
from distill.drafters.build import build_drafter
from distill.errors import ConfigError
from distill.stages.generate import answer_batch
from distill.training.loop import LossSpec, _loss_step, collate, train_drafter
from distill.training.losses import (
    divergence_from_log_probs,
    per_token_divergence,
    top_k_distillation_loss,
    top_k_log_probs,
)
from tests.distill.stages.test_pipeline import draftsmith_tiny

VOCAB = 300
KINDS = ("fkl", "rkl", "jsd", "tvd")

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_qwen2(num_layers: int, seed: int, init_range: float) -> Qwen2ForCausalLM:
    return tiny_qwen2(num_layers, seed, vocab_size=VOCAB, max_position_embeddings=128,
                      initializer_range=init_range, tie_word_embeddings=False, pad_token_id=0, eos_token_id=VOCAB - 1)


@pytest.fixture(scope="module")
def target():
    return _tiny_qwen2(4, seed=0, init_range=0.2)


def _stored_examples(target, k: int, n: int = 6) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB - 1, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    answers = answer_batch(target, prompts, pad_id=0, eos_ids=[VOCAB - 1], max_new_tokens=12, temperature=0.0,
                           top_p=1.0, store_top_k=k)
    return [{"prompt_ids": p, **a} for p, a in zip(prompts, answers)]


# ---------------------------------------------------------------------------------------------
# the coarsened (k + 1 bucket) divergences


def _logits(seed, shape=(5, 7, VOCAB), scale=3.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("kind", KINDS)
def test_full_vocabulary_top_k_equals_the_full_divergence(kind):
    student, teacher = _logits(0), _logits(1)
    top = torch.log_softmax(teacher, -1).topk(VOCAB, dim=-1)
    s, t = top_k_log_probs(student, top.indices, top.values)
    coarse = divergence_from_log_probs(s, t, kind=kind)
    full = per_token_divergence(student, teacher, kind=kind)
    torch.testing.assert_close(coarse, full, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_divergence_is_a_lower_bound_and_acceptance_an_upper_bound(kind, k):
    student, teacher = _logits(2), _logits(3)
    top = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    loss, accept = top_k_distillation_loss(student.flatten(0, 1), top.indices.flatten(0, 1),
                                           top.values.flatten(0, 1), kind=kind)
    full = per_token_divergence(student, teacher, kind=kind).flatten()
    assert torch.all(loss <= full + 1e-5)  # data-processing inequality
    true_accept = 1 - per_token_divergence(student, teacher, kind="tvd").flatten()
    assert torch.all(accept >= true_accept - 1e-5)
    assert torch.all(loss >= -1e-6)


def test_identical_distributions_give_zero_with_stored_top_k():
    logits = _logits(4)
    top = torch.log_softmax(logits, -1).topk(10, dim=-1)
    for kind in KINDS:
        loss, accept = top_k_distillation_loss(logits.flatten(0, 1), top.indices.flatten(0, 1),
                                               top.values.flatten(0, 1), kind=kind)
        assert float(loss.abs().max()) < 1e-5, kind
        assert float(accept.min()) > 1 - 1e-5


def test_top_k_gradients_are_finite_even_when_the_target_is_certain():
    student = _logits(5, (4, VOCAB)).requires_grad_(True)
    ids = torch.arange(3).expand(4, 3).contiguous()
    logprobs = torch.tensor([[0.0, -80.0, -90.0]]).expand(4, 3)  # rest mass rounds to 0
    for kind in KINDS:
        loss, _ = top_k_distillation_loss(student, ids, logprobs, kind=kind)
        loss.mean().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(student.grad).all(), kind
        student.grad = None


def test_top_k_rejects_bad_shapes_and_ids():
    student = _logits(6, (4, VOCAB))
    with pytest.raises(ValueError, match="agree"):
        top_k_log_probs(student, torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="outside the drafter's vocabulary"):
        top_k_log_probs(student, torch.full((4, 2), VOCAB), torch.zeros(4, 2))


# ---------------------------------------------------------------------------------------------
# generate stores what the loss needs, aligned with the tokens


def test_generate_stores_the_distribution_each_token_came_from(target):
    examples = _stored_examples(target, k=5)
    for ex in examples:
        n = len(ex["completion_ids"])
        assert len(ex["top_k_ids"]) == n and all(len(row) == 5 for row in ex["top_k_ids"])
        # greedy: each answer token is its own row's most likely token
        assert [row[0] for row in ex["top_k_ids"]] == ex["completion_ids"]
        # and the stored log-probs are the target's full-sequence forward at those positions
        seq = torch.tensor([ex["prompt_ids"] + ex["completion_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(target(seq).logits[0].float(), -1)
        p = len(ex["prompt_ids"])
        expected = logp[p - 1:p - 1 + n].gather(-1, torch.tensor(ex["top_k_ids"]))
        torch.testing.assert_close(torch.tensor(ex["top_k_logprobs"]), expected, atol=1e-4, rtol=1e-4)


def test_generate_batches_a_shard_by_length_and_writes_it_in_prompt_order(target, tmp_path, monkeypatch):
    """A shard's prompts are batched by length within generate.batch_tokens padded tokens (a long prompt is not
    padded against short ones), the rows come back in prompt order, and each answer is the one the prompt gets
    alone (greedy, float32)."""
    from datasets import load_from_disk

    import distill.stages.generate as generate
    from distill.config import Config, GenerateConfig
    from distill.data.prompts import Prompt

    lengths = [3, 20, 4, 18, 5, 3, 21, 6]
    g = torch.Generator().manual_seed(5)
    encoded = [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    train = [Prompt(id=f"p{i}", messages=[{"role": "user", "content": str(i)}], source="t", category="c")
             for i in range(len(lengths))]
    cfg = Config(generate=GenerateConfig(batch_size=4, batch_tokens=40, shard_size=8, max_new_tokens=6,
                                         store_top_k=0))
    seen, real = [], generate.answer_batch
    monkeypatch.setattr(generate, "answer_batch", lambda model, ids, **kw: seen.append(ids) or real(model, ids, **kw))
    generate._answer_shards(target, train, encoded, tmp_path, {0: "shard"}, cfg, pad_id=0, eos_ids=[VOCAB - 1],
                            fingerprint="f")
    assert sorted(map(len, sum(seen, []))) == sorted(lengths)
    assert all(len(b) == 1 or len(b) * max(map(len, b)) <= 40 for b in seen)
    assert [len(b) for b in seen] == [4, 2, 1, 1]  # 3 3 4 5 (4 rows) | 6 18 (36) | 20 (3 x 20 > 40) | 21 (42 > 40)
    rows = load_from_disk(str(tmp_path / "shard")).to_list()
    assert [r["prompt_id"] for r in rows] == [p.id for p in train] and [r["prompt_ids"] for r in rows] == encoded
    for row, ids in zip(rows, encoded):
        alone = real(target, [ids], pad_id=0, eos_ids=[VOCAB - 1], max_new_tokens=6, temperature=0.0, top_p=1.0)
        assert row["completion_ids"] == alone[0]["completion_ids"]


def test_collate_aligns_stored_rows_with_the_loss_positions(target):
    examples = _stored_examples(target, k=3)
    batch = collate(examples, pad_token_id=0, max_seq_len=14)  # truncation cuts prompts and answers
    n = int(batch["loss_mask"].sum())
    assert batch["top_k_ids"].shape == (n, 3) and batch["top_k_logprobs"].shape == (n, 3)
    assert torch.equal(batch["top_k_ids"][:, 0], batch["labels"][batch["loss_mask"]])


def test_stored_full_vocabulary_loss_equals_the_online_loss(target):
    """With k = vocabulary the stored path computes exactly what scoring the target online does."""
    examples = _stored_examples(target, k=VOCAB)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling").eval()
    batch = collate(examples, pad_token_id=0, max_seq_len=64)
    online = {k: v for k, v in batch.items() if not k.startswith("top_k")}
    for kind in KINDS:
        spec = LossSpec(kind)
        with torch.no_grad():
            stored_loss, stored_accept, stored_agree = _loss_step(drafter, None, batch, spec)
            online_loss, online_accept, online_agree = _loss_step(drafter, target, online, spec)
        assert math.isclose(stored_loss.item(), online_loss.item(), rel_tol=1e-3, abs_tol=1e-4), kind
        assert math.isclose(stored_accept, online_accept, rel_tol=1e-3), kind
        assert stored_agree == online_agree, kind
    # the agreement count is the number of positions where both argmaxes coincide
    with torch.no_grad():
        keep = online["loss_mask"]
        mine = drafter(input_ids=online["input_ids"], attention_mask=online["attention_mask"]).logits[keep]
        theirs = target(input_ids=online["input_ids"], attention_mask=online["attention_mask"]).logits[keep]
    expected = float((mine.argmax(-1) == theirs.argmax(-1)).sum())
    assert online_agree == expected
    with torch.no_grad():  # a model agrees with itself at every position
        assert _loss_step(target, target, online, LossSpec("fkl"))[2] == int(keep.sum())


def test_training_on_stored_log_probs_needs_no_target(target, tmp_path):
    examples = _stored_examples(target, k=64)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    result = train_drafter(drafter, None, examples[:4],
                           loop_settings(loss="fkl", lr=5e-3, max_steps=20, batch_size=2), val_examples=examples[:4],
                           output_dir=tmp_path, progress=False)
    assert result["val_loss_after"] < 0.6 * result["val_loss_before"]
    assert result["val_expected_acceptance_after"] > result["val_expected_acceptance_before"] + 0.05


def test_missing_target_and_missing_stored_log_probs_is_refused(tmp_path):
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    with pytest.raises(ValueError, match="store_top_k"):
        train_drafter(drafter, None, [{"prompt_ids": [1, 2], "completion_ids": [3, 4]}], loop_settings(max_steps=1),
                      output_dir=tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------
# on-policy data (GKD)


def _plain_examples(n=6):
    g = torch.Generator().manual_seed(1)
    return [{"prompt_ids": torch.randint(1, VOCAB - 1, (5,), generator=g).tolist(),
             "completion_ids": torch.randint(1, VOCAB - 1, (10,), generator=g).tolist()} for _ in range(n)]


def test_on_policy_batches_are_the_drafters_own_samples(target, tmp_path, monkeypatch):
    import distill.training.loop as train_module

    calls = []
    original = train_module._on_policy_batch

    def spy(drafter, batch, **kw):
        fresh = original(drafter, batch, **kw)
        calls.append((batch, fresh))
        return fresh

    monkeypatch.setattr(train_module, "_on_policy_batch", spy)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    result = train_drafter(drafter, target, _plain_examples(),
                           loop_settings(loss="rkl", lr=1e-3, max_steps=6, batch_size=2, on_policy_fraction=0.5),
                           output_dir=tmp_path, progress=False)
    assert math.isfinite(result["final_loss"])
    # lambda = 0.5 over 6 seeded draws: some batches on-policy, some not, the same ones on every run
    on_policy_steps = [s for s in range(1, 7) if train_module._draw(0, s, 0) < 0.5]
    assert len(calls) == len(on_policy_steps) and 0 < len(calls) < 6
    for old, fresh in calls:
        for row in range(2):
            prompt = old["input_ids"][row][:int(old["loss_mask"][row].nonzero()[0]) + 1]
            first = int(fresh["loss_mask"][row].nonzero()[0]) + 1
            assert torch.equal(fresh["input_ids"][row][:first], prompt)  # same prompt
        assert int(fresh["loss_mask"].sum(1).max()) <= 10  # answers no longer than the stored ones


def test_on_policy_answers_come_from_the_drafter():
    """At a near-zero sampling temperature the on-policy answers are the drafter's greedy answers."""
    from distill.training.loop import _on_policy_batch

    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.2), init="sibling")
    examples = _plain_examples(2)
    batch = collate(examples, pad_token_id=0, max_seq_len=64)
    fresh = _on_policy_batch(drafter, batch, pad_token_id=0, eos_token_ids=[VOCAB - 1], temperature=1e-6,
                             max_seq_len=64)
    assert drafter.training  # restored after generating
    for row, ex in enumerate(examples):
        with torch.no_grad():
            greedy = drafter.eval().generate(torch.tensor([ex["prompt_ids"]]), max_new_tokens=10, do_sample=False,
                                             eos_token_id=VOCAB - 1, pad_token_id=0)[0, 5:]
        drafter.train()
        answer = fresh["labels"][row][fresh["loss_mask"][row]]
        assert answer.tolist() == greedy.tolist()


@pytest.mark.parametrize("overrides, message", [
    (dict(target_source="stored", on_policy_fraction=0.5), "target_source=online"),
    (dict(loss="ce", target_source="online", on_policy_fraction=0.5), "fkl, rkl, jsd or tvd"),
    (dict(on_policy_fraction=1.5), "lambda"),
    (dict(target_source="stored", temperature=2.0), "temperature 1"),
    (dict(target_source="disk"), "online"),
])
def test_distill_data_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DistillConfig(**overrides)


def test_qlora_without_cuda_says_what_to_use(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: QLoRA is allowed here")
    proc = draftsmith_tiny("distill", "experiment=tiny", "distill.method=qlora", "drafter.init=sibling",
                           "drafter.num_layers=null", f"outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "distill.method=lora" in proc.stderr


def test_stored_log_probs_through_the_cli(tmp_path):
    """generate.store_top_k + distill.target_source=stored: a tiny pipeline, and the refusal without them."""
    proc = draftsmith_tiny("pipeline", "experiment=tiny", "distill.target_source=stored", f"outputs={tmp_path}/a",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "generate.store_top_k=20" in proc.stderr
    proc = draftsmith_tiny("pipeline", "experiment=tiny", "generate.store_top_k=8", "distill.target_source=stored",
                      f"outputs={tmp_path}/b", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(open(proc.stdout.strip().splitlines()[-1]).read())
    assert report["outputs_match_target"] is True


def test_stored_log_probs_with_a_reduced_vocabulary_match_the_online_restriction(target):
    """k = vocabulary: the stored path drops the tokens outside the draft vocabulary and renormalises the
    target exactly as the online path's EAGLE-3 restriction does; acceptance counts that mass as rejected."""
    from distill.models.reduced_vocab import reduce_vocabulary

    examples = _stored_examples(target, k=VOCAB)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling").eval()
    keep = torch.arange(0, VOCAB, 2)  # half the vocabulary
    reduce_vocabulary(drafter, keep)
    batch = collate(examples, pad_token_id=0, max_seq_len=64)
    online = {k: v for k, v in batch.items() if not k.startswith("top_k")}
    for kind in KINDS:
        with torch.no_grad():
            stored_loss, stored_accept, stored_agree = _loss_step(drafter, None, batch, LossSpec(kind))
            online_loss, online_accept, online_agree = _loss_step(drafter, target, online, LossSpec(kind))
        assert math.isfinite(stored_loss.item())
        assert math.isclose(stored_loss.item(), online_loss.item(), rel_tol=1e-3, abs_tol=1e-4), kind
        assert math.isclose(stored_accept, online_accept, rel_tol=1e-3), kind
        assert stored_agree == online_agree, kind


# ---------------------------------------------------------------------------------------------
# memory exhaustion


@pytest.mark.parametrize("error, asked", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)"), 34359738368),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"),
     2 * 2**30),
    (MemoryError(), 0),
    (RuntimeError("shape mismatch"), None),
])
def test_out_of_memory_is_recognised_with_the_size_asked(error, asked):
    from distill.errors import out_of_memory_bytes

    assert out_of_memory_bytes(error) == asked


def test_out_of_memory_in_a_step_says_what_to_lower(target, tmp_path, monkeypatch):
    import distill.training.loop as train_module
    from distill.errors import OutOfMemoryError

    real = train_module._loss_step
    calls = {"n": 0}

    def failing(drafter, target, batch, spec):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes.")
        return real(drafter, target, batch, spec)

    monkeypatch.setattr(train_module, "_loss_step", failing)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    with pytest.raises(OutOfMemoryError) as info:
        train_drafter(drafter, target, _plain_examples(),
                      loop_settings(max_steps=4, batch_size=2, checkpoint_every=1), output_dir=tmp_path, progress=False)
    message = str(info.value)
    assert "step 3" in message and "8.00 GiB" in message and "distill.batch_size (now 2;" in message
    assert "checkpoint-2" in message  # the last good checkpoint, from which the same command resumes


@pytest.mark.parametrize("kind", KINDS + ("ce",))
def test_stored_log_probs_and_a_reduced_vocabulary_train_with_finite_gradients(target, kind):
    from distill.models.reduced_vocab import reduce_vocabulary

    examples = _stored_examples(target, k=16)
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    reduce_vocabulary(drafter, torch.arange(0, VOCAB, 3))  # many stored ids and labels fall outside
    batch = collate(examples, pad_token_id=0, max_seq_len=64)
    loss, _, _ = _loss_step(drafter, None, batch, LossSpec(kind))
    loss.backward()
    assert math.isfinite(loss.item()), kind
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads), kind


def test_pipeline_preflight_checks_the_new_sizes_before_generating(tmp_path):
    proc = draftsmith_tiny("pipeline", "experiment=tiny", "drafter.draft_vocab_size=100000", f"outputs={tmp_path}",
                      cwd=tmp_path)
    assert proc.returncode == 2 and "drafter.draft_vocab_size=100000" in proc.stderr and "[1/4]" not in proc.stdout
    proc = draftsmith_tiny("pipeline", "experiment=tiny", "generate.store_top_k=600", f"outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and "use at most" in proc.stderr and "[1/4]" not in proc.stdout
    proc = draftsmith_tiny("generate", "experiment=tiny", "generate.store_top_k=600", f"outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and "use at most" in proc.stderr


def test_only_the_newest_checkpoints_are_kept(target, tmp_path):
    drafter = build_drafter(_tiny_qwen2(2, seed=1, init_range=0.02), init="sibling")
    train_drafter(drafter, target, _plain_examples(),
                  loop_settings(max_steps=5, batch_size=2, checkpoint_every=1, keep_checkpoints=2),
                  output_dir=tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    with pytest.raises(ConfigError, match="keep_checkpoints"):
        DistillConfig(keep_checkpoints=-1)
