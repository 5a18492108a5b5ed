"""Training loop (distill/training/loop.py) on tiny random Qwen2 models."""

import dataclasses
import json

import pytest
import torch
from loop_settings import loop_settings
from tiny_models import tiny_qwen2
from transformers import Qwen2ForCausalLM

from distill.drafters.build import LoraSettings, build_drafter
from distill.errors import ConfigError, DraftsmithError
from distill.training.loop import collate, train_drafter, validate

VOCAB = 300


pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_qwen2(num_layers: int, seed: int, init_range: float) -> Qwen2ForCausalLM:
    return tiny_qwen2(num_layers, seed, vocab_size=VOCAB, max_position_embeddings=128,
                      initializer_range=init_range, tie_word_embeddings=False, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    # a wide init makes peaked next-token distributions, far from a fresh drafter's
    return _tiny_qwen2(4, seed=0, init_range=0.2).eval()


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(1)

    def ids(lo, hi):
        return torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": ids(3, 10), "completion_ids": ids(5, 20)} for _ in range(10)]


def _sibling(seed=1):
    return build_drafter(_tiny_qwen2(2, seed=seed, init_range=0.02), init="sibling")


def _lora_cut(target, dropout=0.1):
    torch.manual_seed(123)
    return build_drafter(target, init="layers", num_layers=2, layer_selection="even",
                         lora=LoraSettings(r=4, alpha=8, dropout=dropout))


def _losses(path):
    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


class _Recorder:
    def __init__(self, fail_at=None):
        self.records, self.fail_at = [], fail_at

    def log(self, metrics, step):
        if step == self.fail_at:
            raise KeyboardInterrupt(f"simulated crash at step {step}")
        self.records.append((step, metrics))


def test_collate_masks_prompt_and_padding():
    batch = collate([{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]},
                     {"prompt_ids": [6], "completion_ids": [7, 8, 9, 10]}], pad_token_id=0, max_seq_len=8)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert batch["labels"].tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 10, 0]]
    # positions whose next token is a completion token
    assert batch["loss_mask"].tolist() == [[False, False, True, True, False], [True, True, True, True, False]]
    padded = collate([{"prompt_ids": [1], "completion_ids": [2]}, {"prompt_ids": [3, 4], "completion_ids": [5, 6]}],
                     pad_token_id=0, max_seq_len=8)
    assert padded["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert padded["loss_mask"].tolist() == [[True, False, False, False], [False, True, True, False]]
    # too long: the prompt keeps its tail (half the window), the completion its head
    cut = collate([{"prompt_ids": list(range(1, 11)), "completion_ids": list(range(11, 21))}], pad_token_id=0,
                  max_seq_len=8)
    assert cut["input_ids"].tolist() == [[7, 8, 9, 10, 11, 12, 13, 14]]


def test_fkl_steps_reduce_loss_and_raise_acceptance(target, examples, tmp_path):
    torch.manual_seed(0)
    logger = _Recorder()
    result = train_drafter(_sibling(), target, examples,
                           loop_settings(loss="fkl", lr=1e-2, max_steps=8, batch_size=4), output_dir=tmp_path,
                           val_examples=examples[:6], logger=logger, progress=False)
    assert result["val_loss_after"] < 0.95 * result["val_loss_before"]
    assert result["val_expected_acceptance_after"] > result["val_expected_acceptance_before"]
    assert result["steps"] == 8 and result["tokens_seen"] > 0 and result["tokens_per_s"] > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert {"loss", "lr", "tokens", "tokens_per_s", "expected_acceptance"} <= lines[0].keys()
    assert [s for s, m in logger.records if "loss" in m] == list(range(1, 9))
    # the held-out curve: before (step 0) and after (step 8), in validation.jsonl and the logger
    curve = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0, 8] == [s for s, m in logger.records if "val_loss" in m]
    assert curve[0]["val_loss"] == result["val_loss_before"] and curve[1]["val_loss"] == result["val_loss_after"]
    assert result["val_top1_agreement_after"] >= result["val_top1_agreement_before"]
    assert lines[-1]["lr"] < lines[0]["lr"] == 1e-2  # linear decay
    ckpt = tmp_path / "checkpoint-8"
    assert result["checkpoint"] == str(ckpt)
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["examples_seen"] == 32
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_auto_mixed_precision_is_bf16_only_where_bf16_is_fast(monkeypatch, caplog):
    import distill.hardware
    import distill.models.loading
    import distill.stages.distill

    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: False)
    assert distill.hardware.resolve_mixed_precision("auto") == "no"
    assert distill.hardware.resolve_mixed_precision("bf16") == "bf16" and distill.hardware.resolve_mixed_precision("no") == "no"
    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: True)
    assert distill.hardware.resolve_mixed_precision("auto", "cuda") == "bf16"
    # bf16 asked for on a CPU without bf16 units: trained as asked, with a warning that says why it is slow
    monkeypatch.setattr(distill.stages.distill, "bf16_is_fast", lambda device=None: False)
    with caplog.at_level("WARNING"):
        assert distill.stages.distill._mixed_precision("bf16") == "bf16"
    assert "no bf16 matrix units" in caplog.text and "distill.mixed_precision=auto" in caplog.text
    caplog.clear()
    assert distill.stages.distill._mixed_precision("auto") in ("no", "bf16") and not caplog.text


def test_train_drafter_takes_auto_mixed_precision(target, examples, tmp_path, monkeypatch):
    # auto as a host without bf16 units resolves it: accelerate keeps the first precision a process asked for,
    # and the other tests in this process trained without autocast (on a bf16 host auto would ask for bf16)
    import distill.hardware
    import distill.models.loading

    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: False)
    result = train_drafter(_sibling(), target, examples,
                           loop_settings(loss="fkl", lr=1e-2, max_steps=1, batch_size=2, mixed_precision="auto"),
                           output_dir=tmp_path, progress=False)
    assert result["steps"] == 1 and result["final_loss"] > 0


def test_resume_matches_uninterrupted_run(target, examples, tmp_path):
    # 4 examples per step over 10 examples: the stream crosses an epoch boundary mid-batch
    settings = loop_settings(loss="jsd", lr=5e-3, max_steps=4, batch_size=2, grad_accum=2, warmup_steps=1,
                             checkpoint_every=2, seed=7)
    torch.manual_seed(0)
    full = train_drafter(_lora_cut(target), target, examples, settings, output_dir=tmp_path / "a", progress=False)

    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(_lora_cut(target), target, examples, settings, output_dir=tmp_path / "b",
                      logger=_Recorder(fail_at=4), progress=False)
    assert len(_losses(tmp_path / "b")) == 4 and (tmp_path / "b" / "checkpoint-2").is_dir()

    torch.manual_seed(999)  # a different RNG state and fresh adapters: all restored from the checkpoint
    resumed = train_drafter(_lora_cut(target), target, examples, settings, output_dir=tmp_path / "b",
                            resume_from=tmp_path / "b" / "checkpoint-2", progress=False)
    assert len(_losses(tmp_path / "b")) == 4
    assert torch.allclose(torch.tensor(_losses(tmp_path / "b")), torch.tensor(_losses(tmp_path / "a")),
                          rtol=1e-6, atol=0)
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-6)
    assert resumed["tokens_seen"] == full["tokens_seen"]

    with pytest.raises(DraftsmithError, match="batch_size"):
        train_drafter(_lora_cut(target), target, examples, dataclasses.replace(settings, batch_size=3),
                      output_dir=tmp_path / "c", resume_from=tmp_path / "b" / "checkpoint-2", progress=False)


def test_nan_loss_names_the_step(target, examples, tmp_path):
    calls = {"n": 0}

    def poison(module, args, output):
        calls["n"] += 1
        if calls["n"] > 2:  # the third target forward: step 3 with grad_accum=1
            output.logits.fill_(float("nan"))

    handle = target.register_forward_hook(poison)
    try:
        with pytest.raises(DraftsmithError, match=r"step 3; the last good checkpoint is .*checkpoint-2"):
            train_drafter(_sibling(), target, examples, loop_settings(max_steps=5, batch_size=2, checkpoint_every=2,
                                                                      packing=False),
                          output_dir=tmp_path, progress=False)
    finally:
        handle.remove()
    assert len(_losses(tmp_path)) == 2


def test_lora_training_changes_only_adapters(target, examples, tmp_path):
    drafter = _lora_cut(target, dropout=0.0)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    train_drafter(drafter, target, examples, loop_settings(loss="tvd", lr=1e-2, max_steps=3, batch_size=4),
                  output_dir=tmp_path, progress=False)
    changed = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)
    ckpt = tmp_path / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


@pytest.mark.parametrize("make", ["lora", "full"])
def test_gradient_checkpointing_trains_the_same_weights(target, examples, tmp_path, make):
    """Recomputing activations in the backward changes memory, not the gradients: the same losses and weights."""
    settings = loop_settings(loss="fkl", lr=1e-2, max_steps=3, batch_size=4)
    drafters = {}
    for checkpointing in (False, True):
        drafter = _lora_cut(target, dropout=0.0) if make == "lora" else _sibling()
        out = tmp_path / str(checkpointing)
        train_drafter(drafter, target, examples, dataclasses.replace(settings, gradient_checkpointing=checkpointing),
                      output_dir=out, progress=False)
        drafters[checkpointing] = (drafter, _losses(out))
    (plain, plain_losses), (recomputed, recomputed_losses) = drafters[False], drafters[True]
    assert recomputed_losses == pytest.approx(plain_losses, rel=1e-5)
    assert any(m.gradient_checkpointing for m in recomputed.modules() if hasattr(m, "gradient_checkpointing"))
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss", ["rkl", "ce", "tvd"])
def test_other_losses_run(target, examples, tmp_path, loss):
    result = train_drafter(_sibling(), target, examples[:4], loop_settings(loss=loss, max_steps=1, batch_size=2),
                           output_dir=tmp_path, progress=False)
    assert result["final_loss"] > 0


def test_validate_every_writes_a_curve_that_survives_resume(target, examples, tmp_path):
    settings = loop_settings(loss="fkl", lr=1e-2, max_steps=6, batch_size=4, checkpoint_every=2, validate_every=2)
    run = dict(val_examples=examples[:4], progress=False)
    torch.manual_seed(0)
    train_drafter(_sibling(), target, examples, settings, output_dir=tmp_path / "a", **run)
    curve = [json.loads(line) for line in (tmp_path / "a" / "validation.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0, 2, 4, 6]
    assert {"val_loss", "val_expected_acceptance", "val_top1_agreement"} <= curve[0].keys()
    assert all(0 <= p["val_top1_agreement"] <= 1 for p in curve) and curve[-1]["val_loss"] < curve[0]["val_loss"]

    torch.manual_seed(0)  # killed after step 4's validation: the resumed run redoes 5-6 and keeps 0-4
    with pytest.raises(KeyboardInterrupt):
        train_drafter(_sibling(), target, examples, settings, output_dir=tmp_path / "b", logger=_Recorder(fail_at=5),
                      **run)
    train_drafter(_sibling(), target, examples, settings, output_dir=tmp_path / "b",
                  resume_from=tmp_path / "b" / "checkpoint-4", **run)
    resumed = [json.loads(line) for line in (tmp_path / "b" / "validation.jsonl").read_text().splitlines()]
    assert [p["step"] for p in resumed] == [0, 2, 4, 6]
    assert [p["val_loss"] for p in resumed] == pytest.approx([p["val_loss"] for p in curve], rel=1e-5)


def test_validate_restores_mode_and_counts_tokens(target, examples):
    drafter = _sibling()
    metrics = validate(drafter, target, examples[:3], batch_size=2)
    expected_tokens = sum(len(e["completion_ids"]) for e in examples[:3])
    assert metrics["tokens"] == expected_tokens and 0 < metrics["expected_acceptance"] < 1
    assert 0 <= metrics["top1_agreement"] <= 1
    assert drafter.training


def _folder_bytes(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("make", ["full", "lora"])
def test_checkpoint_bytes_matches_the_folder_written(make, target, examples, tmp_path):
    from distill.training.checkpoint import checkpoint_bytes

    drafter = _sibling() if make == "full" else _lora_cut(target)
    estimate = checkpoint_bytes(drafter)
    train_drafter(drafter, target, examples, loop_settings(max_steps=1, batch_size=2), output_dir=tmp_path,
                  progress=False)
    written = _folder_bytes(tmp_path / "checkpoint-1")
    assert 0.9 * written < estimate < 1.1 * written, (estimate, written)


def test_too_little_disk_for_one_checkpoint_is_refused_before_training(target, examples, tmp_path, monkeypatch):
    import collections

    from distill.errors import DiskFullError
    from distill.training import checkpoint as checkpoint_module

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(DiskFullError, match=r"training checkpoint \(weights \+ optimizer state\) at .*: "
                                            r"about .* needed, 1000 bytes free; .*outputs="):
        train_drafter(_sibling(), target, examples, loop_settings(max_steps=4, batch_size=2), output_dir=tmp_path,
                      progress=False)
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("*checkpoint*"))


def test_disk_that_holds_fewer_checkpoints_than_kept_warns(target, examples, tmp_path, monkeypatch, caplog):
    import collections

    from distill.training import checkpoint as checkpoint_module

    size = checkpoint_module.checkpoint_bytes(_sibling())
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage(10**12, 0, int(1.5 * size)))
    with caplog.at_level("WARNING", logger="distill.training.checkpoint"):
        train_drafter(_sibling(), target, examples,
                      loop_settings(max_steps=4, batch_size=2, checkpoint_every=1, keep_checkpoints=2),
                      output_dir=tmp_path, progress=False)
    assert "holds 1 of the 3 checkpoints" in caplog.text and "distill.keep_checkpoints" in caplog.text


@pytest.mark.parametrize("message", [
    "[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file: No space left on device",
    # the form torch.save took when the disk filled on 2026-11-30 (no "No space left" in it)
    "[enforce fail at inline_container.cc:672] . unexpected pos 2266342464 vs 2266342356",
])
def test_disk_full_during_a_checkpoint_keeps_the_earlier_ones(message, target, examples, tmp_path, monkeypatch):
    from distill.errors import DiskFullError
    from distill.training import checkpoint as checkpoint_module

    real_save, calls = checkpoint_module.torch.save, {"n": 0}

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:  # the second checkpoint's optimizer state
            raise RuntimeError(message)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)
    with pytest.raises(DiskFullError, match=r"checkpoint-4 .*earlier checkpoints in .* are intact"):
        train_drafter(_sibling(), target, examples, loop_settings(max_steps=6, batch_size=2, checkpoint_every=2),
                      output_dir=tmp_path, progress=False)
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (tmp_path / "checkpoint-4").exists() and not list(tmp_path.glob(".checkpoint-4*"))


def test_cut_examples_are_warned_about_once_per_split(caplog):
    from distill.training.loop import _usable_examples

    long = [{"prompt_ids": list(range(10)), "completion_ids": list(range(10))} for _ in range(3)]
    with caplog.at_level("WARNING", logger="distill.training.loop"):
        for _ in range(3):  # validation runs every validate_every steps
            kept = _usable_examples(long, max_seq_len=8, what="validation")
        _usable_examples(long, max_seq_len=8, what="training")
    assert len(kept) == 3 and all(len(ex["prompt_ids"]) + len(ex["completion_ids"]) <= 8 for ex in kept)
    cut = [r.getMessage() for r in caplog.records if "were cut" in r.getMessage()]
    assert cut == ["3 of 3 validation examples are longer than max_seq_len=8 and were cut (prompt from the left, "
                   "answer from the right): raise distill.max_seq_len to train on whole examples",
                   "3 of 3 training examples are longer than max_seq_len=8 and were cut (prompt from the left, "
                   "answer from the right): raise distill.max_seq_len to train on whole examples"]


def test_constant_schedule_and_budget_checkpoints_are_kept_past_pruning(target, examples, tmp_path):
    # one run, several training budgets: the lr stays at its peak after the warmup, and the checkpoint_at steps
    # survive keep_checkpoints=1, each with the tokens it had seen
    result = train_drafter(_sibling(), target, examples,
                           loop_settings(lr=1e-3, lr_schedule="constant", warmup_steps=2, max_steps=7, batch_size=2,
                                         checkpoint_every=2, keep_checkpoints=1, checkpoint_at=[1, 3]),
                           output_dir=tmp_path, progress=False)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[0] < 1e-3 and lrs[2:] == [1e-3] * 5
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    assert kept == [1, 3, 7]  # 2, 4 and 6 pruned; 7, the last, is the newest
    tokens = [json.loads((tmp_path / f"checkpoint-{s}" / "trainer_state.json").read_text())["tokens_seen"]
              for s in kept]
    assert 0 < tokens[0] < tokens[1] < tokens[2] == result["tokens_seen"]


def test_checkpoint_at_outside_the_run_is_refused():
    with pytest.raises(ConfigError, match="distill.checkpoint_at"):
        loop_settings(max_steps=5, checkpoint_at=[3, 6])
    with pytest.raises(ConfigError, match="distill.lr_schedule"):
        loop_settings(lr_schedule="cosine")


@pytest.mark.parametrize("lora", [True, False])
def test_a_budget_checkpoint_holds_what_a_run_of_that_length_trains(target, examples, tmp_path, lora):
    # under the constant schedule the first 3 steps of a 6-step run are a 3-step run: its checkpoint-3, loaded
    # into an untrained drafter as evaluate.checkpoints loads it, has the weights the short run ends with
    from distill.drafters.build import merge_drafter
    from distill.training.checkpoint import checkpoint_tokens, trained_drafter_at

    def make():
        torch.manual_seed(123)
        return build_drafter(target, init="layers", num_layers=2, layer_selection="even",
                             lora=LoraSettings(r=4, alpha=8, dropout=0.0) if lora else None)

    settings = dict(loss="fkl", lr=1e-2, lr_schedule="constant", warmup_steps=1, batch_size=3)
    long = train_drafter(make(), target, examples, loop_settings(max_steps=6, checkpoint_at=[3], **settings),
                         output_dir=tmp_path / "long", progress=False)
    short_drafter = make()
    short = train_drafter(short_drafter, target, examples, loop_settings(max_steps=3, **settings),
                          output_dir=tmp_path / "short", progress=False)
    torch.manual_seed(123)
    untrained = build_drafter(target, init="layers", num_layers=2, layer_selection="even")
    loaded = trained_drafter_at(untrained, tmp_path / "long" / "checkpoint-3")
    expected = merge_drafter(short_drafter).state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    assert checkpoint_tokens(tmp_path / "long" / "checkpoint-3")["tokens_seen"] == short["tokens_seen"] \
        < long["tokens_seen"]


def test_a_lora_checkpoint_for_another_drafter_is_refused_with_its_folder(target, examples, tmp_path):
    from distill.training.checkpoint import trained_drafter_at

    train_drafter(_lora_cut(target, dropout=0.0), target, examples, loop_settings(max_steps=1, batch_size=2),
                  output_dir=tmp_path, progress=False)
    # the same layer names, another hidden size
    other = build_drafter(tiny_qwen2(2, 5, vocab_size=VOCAB, max_position_embeddings=128, hidden_size=48,
                                     tie_word_embeddings=False, pad_token_id=0), init="sibling")
    with pytest.raises(DraftsmithError, match="checkpoint-1"):
        trained_drafter_at(other, tmp_path / "checkpoint-1")
