"""EAGLE-3 head training (distill.training.head_loop, distill.drafters.eagle3) on tiny random Qwen2 targets."""

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_qwen2

from decode.eagle3.decoding import eagle3_generate
from decode.eagle3.head import Eagle3Head
from decode.speculative import target_generate
from distill.config import DistillConfig
from distill.drafters.eagle3 import initial_head
from distill.training.head_loop import head_loss, train_head, validate_head
from distill.training.loop import collate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24


def fresh_dir() -> Path:
    return Path(tempfile.mkdtemp())


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(4, 0, vocab_size=VOCAB, head_scale=5.0)


@pytest.fixture(scope="module")
def examples(target):
    """The target's greedy answers to 24 seeded prompts."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(24):
        prompt = torch.randint(0, VOCAB, (6,), generator=generator).tolist()
        answer = target_generate(target, torch.tensor([prompt]), max_new_tokens=20, eos_token_ids=[]).new_tokens
        out.append({"prompt_ids": prompt, "completion_ids": answer.tolist(), "finish_reason": "length"})
    return out


def settings(**changes) -> DistillConfig:
    base = dict(lr=3e-3, lr_schedule="constant", max_steps=30, batch_size=4, ttt_steps=3, checkpoint_every=0,
                keep_checkpoints=5, mixed_precision="no", loss="fkl")
    return DistillConfig(**{**base, **changes})


def new_head(target, examples, head_init="random", size=None):
    return initial_head(target, [e["completion_ids"] for e in examples], draft_vocab_size=size, aux_layers=None,
                        head_init=head_init, seed=0)


def test_loss_counts_each_step_at_its_shifted_answer_positions(target, examples):
    head = new_head(target, examples)
    batch = collate(examples[:3], pad_token_id=0, max_seq_len=64)
    result = head_loss(head, target, batch, steps=3)
    loss, agree, counted = result.loss, result.agree, result.counted
    assert counted == [60, 60, 60]  # every answer token, each step from its own block start
    short = collate([{**examples[0], "prompt_ids": examples[0]["prompt_ids"][:2]}], pad_token_id=0, max_seq_len=64)
    assert head_loss(head, target, short, steps=3).counted == [20, 19, 18]  # step j needs an entry j before the answer
    assert torch.isfinite(loss) and loss.requires_grad and all(0 <= a <= c for a, c in zip(agree, counted))
    loss.backward()
    assert head.fc.weight.grad is not None and all(p.grad is None for p in target.parameters())


def test_training_raises_acceptance_and_the_decoder_stays_lossless(target, examples, tmp_path):
    head = new_head(target, examples, size=16)
    train, val = examples[:20], examples[20:]
    result = train_head(head, target, train, settings(), output_dir=tmp_path / "checkpoints", pad_token_id=0,
                        val_examples=val, progress=False, validation_draft_length=3)
    before, after = result["validation_before"], result["validation_after"]
    assert after["loss"] < 0.5 * before["loss"]
    assert after["step1_agreement"] > before["step1_agreement"] + 0.2
    assert after["simulated_tau"] > before["simulated_tau"] + 0.3
    lines = (tmp_path / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31))
    head.eval()
    for example in val:
        out = eagle3_generate(target, head, torch.tensor([example["prompt_ids"]]), draft_length=3,
                              max_new_tokens=20, eos_token_ids=[])
        assert out.new_tokens.tolist() == example["completion_ids"]
    saved = Eagle3Head.load(result["checkpoint"])
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), head.state_dict().values()))


def test_resume_continues_exactly(target, examples, tmp_path):
    straight = new_head(target, examples)
    train_head(straight, target, examples, settings(max_steps=4), output_dir=tmp_path / "a", pad_token_id=0,
               progress=False)
    first = new_head(target, examples)
    train_head(first, target, examples, settings(max_steps=2, checkpoint_every=2), output_dir=tmp_path / "b",
               pad_token_id=0, progress=False)
    resumed = new_head(target, examples)
    train_head(resumed, target, examples, settings(max_steps=4), output_dir=tmp_path / "b", pad_token_id=0,
               progress=False, resume_from=tmp_path / "b" / "checkpoint-2")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    again = new_head(target, examples)  # validation before training is written once, by the run that measured it
    train_head(again, target, examples, settings(max_steps=2, checkpoint_every=2), output_dir=tmp_path / "c",
               pad_token_id=0, progress=False, val_examples=examples[:3])
    train_head(new_head(target, examples), target, examples, settings(max_steps=3), output_dir=tmp_path / "c",
               pad_token_id=0, progress=False, val_examples=examples[:3], resume_from=tmp_path / "c" / "checkpoint-2")
    lines = (tmp_path / "c" / "validation.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 2, 3]


def test_head_from_the_target_copies_its_last_layer_and_head_rows(target, examples):
    head = new_head(target, examples, head_init="target", size=10)
    rows = head.draft_to_target
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[rows])
    assert torch.equal(head.midlayer.mlp.down_proj.weight, target.model.layers[-1].mlp.down_proj.weight)
    figures = validate_head(head, target, examples[:4], steps=2, draft_length=2, pad_token_id=0, max_seq_len=64,
                            batch_size=2, progress=False)
    assert set(figures) >= {"loss", "step1_agreement", "step2_agreement", "simulated_tau"}
    with pytest.raises(Exception, match="draft vocabulary"):
        new_head(target, examples, size=VOCAB + 1)
    assert dataclasses.asdict(settings())["ttt_steps"] == 3


def test_validation_replay_equals_the_head_simulation(target, examples):
    """validate_head's tau (drafts from the loss's own pass) equals decode.eagle3.simulation's on the same answers."""
    from decode.eagle3.simulation import head_block_drafts, simulate_head_greedy
    from decode.metrics import DecodeStats

    head = new_head(target, examples, size=16)
    train_head(head, target, examples[:20], settings(max_steps=10), output_dir=fresh_dir(), pad_token_id=0,
               progress=False)
    figures = validate_head(head, target, examples[20:], steps=3, draft_length=4, pad_token_id=0, max_seq_len=64,
                            batch_size=3, progress=False)
    blocks = []
    for e in examples[20:]:
        drafts, _ = head_block_drafts(target, head, e["prompt_ids"], e["completion_ids"], 4)
        blocks.append(simulate_head_greedy(drafts, e["completion_ids"], draft_length=4, max_new_tokens=20))
    assert figures["simulated_tau"] == pytest.approx(DecodeStats.merge(blocks).mean_accepted_tokens)


def test_warmup_applies_to_the_constant_schedule(target, examples, tmp_path):
    head = new_head(target, examples)
    train_head(head, target, examples, settings(max_steps=3, warmup_steps=2), output_dir=tmp_path, pad_token_id=0,
               progress=False)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.0, 1.5e-3, 3e-3])
