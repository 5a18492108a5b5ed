"""Sequence packing (distill/training/packing.py, distill.packing): dense rows, the same loss as padded batches."""

import logging
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.masking_utils
from loop_settings import loop_settings
from tiny_models import tiny_qwen2

from distill.drafters.build import LoraSettings, build_drafter
from distill.errors import DraftsmithError
from distill.models.reduced_vocab import reduce_vocabulary
from distill.training import loop
from distill.training.loop import LossSpec, _loss_step, collate, train_drafter
from decode.packing import pack_rows
from distill.training.packing import check_packing, pack_batch

VOCAB = 300
TOP_K = 8
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(num_layers: int, seed: int, init_range: float = 0.02, **config):
    return tiny_qwen2(num_layers, seed, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=init_range,
                      tie_word_embeddings=False, pad_token_id=0, **config)


@pytest.fixture(scope="module")
def target():
    return _model(4, seed=0, init_range=0.2)


@pytest.fixture(scope="module")
def examples(target):
    """Examples of 6 to 33 tokens, with the target's top-k log-probs stored as generate stores them."""
    g = torch.Generator().manual_seed(3)
    out = []
    for prompt_len, completion_len in [(3, 4), (12, 20), (5, 1), (2, 9), (9, 14), (4, 6), (7, 3), (6, 11)]:
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g).tolist()
        completion = torch.randint(1, VOCAB, (completion_len,), generator=g).tolist()
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + completion])).logits[0]
        # position len(prompt) - 1 + j predicts completion token j
        logprobs = torch.log_softmax(logits[prompt_len - 1:-1].float(), dim=-1).topk(TOP_K, dim=-1)
        out.append({"prompt_ids": prompt, "completion_ids": completion, "top_k_ids": logprobs.indices.tolist(),
                    "top_k_logprobs": logprobs.values.tolist()})
    return out


def _online(examples):
    return [{"prompt_ids": ex["prompt_ids"], "completion_ids": ex["completion_ids"]} for ex in examples]


def test_pack_rows_takes_the_layout_with_the_fewest_cells():
    # a row cap of 8 alone would make 5 + 3 | 4 + 2 (2 x 8 cells); a cap of 7 fills both rows
    assert pack_rows([5, 3, 4, 2], 8) == [[0, 3], [2, 1]]
    assert pack_rows([8, 1, 1], 8) == [[0], [1, 2]]
    assert pack_rows([3, 3, 3], 3) == [[0], [1], [2]]
    # a cap of 12 alone would make 6 + 5 | 4 (2 x 11 cells), worse than padding to the longest (3 x 6)
    assert pack_rows([6, 5, 4], 12) == [[0], [1], [2]]
    assert pack_rows([6, 5, 5, 4], 16) == [[0, 3], [1, 2]]  # 2 x 10 cells
    assert pack_rows([6, 2, 5, 1, 4], 16) == [[0], [2, 3], [4, 1]]  # 3 x 6 cells
    with pytest.raises(ValueError, match="1..8"):
        pack_rows([9], 8)


def test_packed_rows_restart_positions_and_keep_each_example_whole(examples):
    batch = collate(examples, pad_token_id=0, max_seq_len=40)
    packed = pack_batch(batch, max_seq_len=40, pad_token_id=0)
    assert "attention_mask" not in packed
    # 8 examples of 116 tokens: 3 rows of 40 (32 + 6, 23 + 17, 11 + 10 + 10 + 7) instead of 8 x 32
    assert packed["input_ids"].shape == (3, 40) and batch["input_ids"].shape == (8, 32)
    lengths = batch["attention_mask"].sum(1).tolist()
    found = []
    for ids, positions, labels, keep in zip(packed["input_ids"], packed["position_ids"], packed["labels"],
                                            packed["loss_mask"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        for start, end in zip(starts, starts[1:]):
            assert positions[start:end].tolist() == list(range(end - start))  # restarts at 0, then counts up
            segment = ids[start:end].tolist()
            if keep[start:end].any():  # an example: whole, with its own labels and loss positions
                i = next(i for i in range(len(examples)) if batch["input_ids"][i, :lengths[i]].tolist() == segment)
                assert labels[start:end].tolist() == batch["labels"][i, :lengths[i]].tolist()
                assert keep[start:end].tolist() == batch["loss_mask"][i, :lengths[i]].tolist()
                found.append(i)
            else:  # the row's end: padding only
                assert set(segment) == {0} and end == len(positions)
    assert sorted(found) == list(range(len(examples)))  # every example exactly once, none across rows
    assert int(packed["loss_mask"].sum()) == int(batch["loss_mask"].sum())
    assert packed["top_k_ids"].shape == packed["top_k_logprobs"].shape == (int(batch["loss_mask"].sum()), TOP_K)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("source", ["online", "stored"])
@pytest.mark.parametrize("kind", ["fkl", "jsd"])
def test_packed_loss_and_gradients_equal_padded(target, examples, source, kind):
    data = examples if source == "stored" else _online(examples)
    batch = collate(data, pad_token_id=0, max_seq_len=40)
    packed = pack_batch(batch, max_seq_len=40, pad_token_id=0)
    assert packed["input_ids"].shape[0] < batch["input_ids"].shape[0]  # several examples share rows
    spec = LossSpec(kind, 0.3, 1.0)
    drafter = build_drafter(_model(2, seed=1), init="sibling")
    figures, grads = [], []
    for b in (batch, packed):
        drafter.zero_grad(set_to_none=True)
        loss, accept, agree = _loss_step(drafter, target, b, spec)
        loss.backward()
        figures.append((loss.detach(), accept, agree))
        grads.append(_grads(drafter))
    (loss, accept, agree), (packed_loss, packed_accept, packed_agree) = figures
    assert loss.item() > 0.1  # a real divergence, not a trivially equal 0
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-6)
    assert packed_accept == pytest.approx(accept, rel=1e-5) and packed_agree == agree
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_stored_rows_follow_the_packed_loss_positions(target, examples):
    batch = collate(examples, pad_token_id=0, max_seq_len=40)
    packed = pack_batch(batch, max_seq_len=40, pad_token_id=0)
    with torch.no_grad():
        # the target's own logits at the packed loss positions: their top-k must be the stored rows (without a
        # cache: transformers reads packed examples from the position ids only then)
        logits = target(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
    expected = torch.log_softmax(logits[packed["loss_mask"]], dim=-1).topk(TOP_K, dim=-1)
    assert torch.equal(expected.indices, packed["top_k_ids"])
    torch.testing.assert_close(expected.values, packed["top_k_logprobs"], rtol=1e-5, atol=1e-5)


def test_one_example_per_micro_batch_packs_to_itself(examples):
    batch = collate(_online(examples[1:2]), pad_token_id=0, max_seq_len=40)
    packed = pack_batch(batch, max_seq_len=40, pad_token_id=0)
    for key in ("input_ids", "labels", "loss_mask"):
        assert torch.equal(packed[key], batch[key]), key
    assert packed["position_ids"].tolist() == [list(range(batch["input_ids"].shape[1]))]


def _lora_drafter(target):
    torch.manual_seed(123)
    return build_drafter(target, init="layers", num_layers=2, layer_selection="even",
                         lora=LoraSettings(r=4, alpha=8, dropout=0.0))


def _records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def packed_shapes(monkeypatch):
    """(rows before, rows after) of every micro-batch the loop packs."""
    shapes = []

    def spy(batch, **kwargs):
        packed = pack_batch(batch, **kwargs)
        shapes.append((batch["input_ids"].shape[0], packed["input_ids"].shape[0]))
        return packed

    monkeypatch.setattr(loop, "pack_batch", spy)
    return shapes


def _train(target, examples, tmp_path, name, *, online=True, **fields):
    drafter = _lora_drafter(target)
    settings = loop_settings(**{"lr": 1e-2, "max_steps": 3, **fields})
    result = train_drafter(drafter, target if online else None, examples, settings, output_dir=tmp_path / name,
                           progress=False)
    return result, _records(tmp_path / name), drafter


def test_packing_is_a_no_op_with_one_example_per_micro_batch(target, examples, tmp_path):
    plain, plain_records, plain_drafter = _train(target, _online(examples), tmp_path, "plain", batch_size=1,
                                                 packing=False)
    packed, packed_records, packed_drafter = _train(target, _online(examples), tmp_path, "packed", batch_size=1,
                                                    packing=True)
    assert [r["loss"] for r in packed_records] == [r["loss"] for r in plain_records]
    assert [r["tokens"] for r in packed_records] == [r["tokens"] for r in plain_records]
    assert packed["tokens_seen"] == plain["tokens_seen"]
    for (name, a), b in zip(plain_drafter.named_parameters(), packed_drafter.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("source", ["online", "stored"])
def test_training_with_packing_follows_the_padded_run(target, examples, tmp_path, source, packed_shapes):
    data = examples if source == "stored" else _online(examples)
    fields = dict(batch_size=4, grad_accum=2, max_seq_len=40, target_source=source, online=source == "online")
    plain, plain_records, _ = _train(target, data, tmp_path, "plain", packing=False, **fields)
    packed, packed_records, _ = _train(target, data, tmp_path, "packed", packing=True, **fields)
    assert len(packed_shapes) == 6 and any(after < before for before, after in packed_shapes)  # rows were shared
    assert [r["tokens"] for r in packed_records] == [r["tokens"] for r in plain_records]  # the same real tokens
    assert packed["tokens_seen"] == plain["tokens_seen"] == sum(r["tokens"] for r in plain_records)
    for a, b in zip(plain_records, packed_records):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["expected_acceptance"] == pytest.approx(a["expected_acceptance"], rel=1e-4)


def test_on_policy_batches_are_generated_padded_and_packed_for_the_loss(target, examples, tmp_path, packed_shapes):
    fields = dict(batch_size=4, max_seq_len=40, max_steps=1, on_policy_fraction=1.0)
    torch.manual_seed(0)
    _, plain, _ = _train(target, _online(examples), tmp_path, "plain", packing=False, **fields)
    torch.manual_seed(0)
    _, packed, _ = _train(target, _online(examples), tmp_path, "packed", packing=True, **fields)
    assert packed[0]["tokens"] == plain[0]["tokens"] > 0  # the same sampled answers
    assert packed_shapes == [(4, 2)]  # the drafter's 4 answers, 2 to a row
    assert packed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_check_packing_accepts_attention_that_keeps_examples_apart(attention):
    check_packing(_model(2, seed=4, attn_implementation=attention), "the drafter")


def test_check_packing_refuses_a_model_that_attends_across_examples(target, examples, tmp_path, monkeypatch, caplog):
    # as if transformers did not read the example boundaries from the position ids
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(DraftsmithError, match="the target .*attends across packed examples.*packing=false"):
        check_packing(target, "the target")
    with pytest.raises(DraftsmithError, match="the drafter"):
        train_drafter(_lora_drafter(target), target, _online(examples), loop_settings(packing=True),
                      output_dir=tmp_path, progress=False)
    # the default (null) trains padded instead, says so, and records it
    with caplog.at_level(logging.WARNING, logger="distill.training.loop"):
        result = train_drafter(_lora_drafter(target), target, _online(examples), loop_settings(max_steps=1),
                               output_dir=tmp_path / "auto", progress=False)
    assert result["packing"] is False and "training with padded micro-batches" in caplog.text
    # a reduced-vocabulary head's -inf logits outside its tokens do not hide the difference
    reduced = reduce_vocabulary(_model(2, seed=5), torch.arange(0, target.config.vocab_size, 2))
    with pytest.raises(DraftsmithError, match="reduced drafter .*attends across packed examples"):
        check_packing(reduced, "the reduced drafter")


def test_check_packing_accepts_a_reduced_vocabulary_head():
    check_packing(reduce_vocabulary(_model(2, seed=5), torch.arange(0, 40)), "the drafter")


def _script_env():
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
            "OMP_NUM_THREADS": "1"}


@pytest.mark.extra  # a script's check: python -m pytest -m extra
@pytest.mark.parametrize("store_top_k", [0, 8])
def test_throughput_script_times_both_modes_on_the_same_tokens(tmp_path, store_top_k):
    import datasets

    done = subprocess.run([sys.executable, "-m", "distill.cli", "generate", "experiment=tiny",
                           f"generate.store_top_k={store_top_k}", f"outputs={tmp_path}/outputs"],
                          capture_output=True, text=True, cwd=tmp_path, env=_script_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [gen] = list((tmp_path / "outputs" / "generate").iterdir())
    # 8 examples, 2 timed steps of 4 after none untimed: every example once
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "packing_throughput.py"), "--generate", str(gen),
                          "--drafter", "tiny-drafter", "--steps", "2", "--warmup-steps", "0", "--batch-size", "4",
                          "--max-seq-len", "2048", "--lora-r", "2", "--out", str(tmp_path / "pt")],
                         capture_output=True, text=True, cwd=tmp_path, env=_script_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "pt" / "packing_throughput.json").read_text())
    rows = datasets.load_from_disk(str(gen / "dataset"))
    assert report["examples"] == len(rows) == 8 and report["stored_targets"] == bool(store_top_k)
    real = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    padded, packed = report["modes"]["padded"], report["modes"]["packed"]
    assert padded["real"] == packed["real"] == real  # prompt + answer tokens, no padding
    assert padded["completion"] == packed["completion"] == sum(len(r["completion_ids"]) for r in rows)
    assert packed["cells"] <= padded["cells"] and 0 < padded["density"] <= packed["density"] <= 1
    assert report["ratio"] == pytest.approx(packed["real_tokens_per_s"] / padded["real_tokens_per_s"])
    assert "packed / padded real tokens/s: " in run.stdout
