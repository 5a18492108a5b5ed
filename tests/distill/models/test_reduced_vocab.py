"""EAGLE-3-style reduced draft vocabulary (distill/models/reduced_vocab.py) on tiny random Qwen2 models."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_settings import loop_settings
from tiny_models import tiny_qwen2
from transformers import AutoModelForCausalLM

from decode.quantization import PerTokenDynamicLinear, quantize_drafter
from decode.sampling import process_logits
from decode.speculative import speculative_generate, target_generate
from distill.config import DrafterConfig
from distill.drafters.build import LoraSettings, build_drafter, merge_drafter
from distill.errors import ConfigError
from distill.models.reduced_vocab import (
    DRAFT_VOCAB_FILE,
    ReducedHead,
    apply_saved_draft_vocab,
    coverage,
    draft_vocabulary,
    draft_vocabulary_of,
    expand_vocabulary,
    load_drafter,
    reduce_vocabulary,
    reduced_head,
    restrict_logits,
    save_drafter,
)
from distill.models.tiny import tiny_model, tiny_tokenizer
from distill.training.loop import train_drafter
from tests.decode.test_speculative import first_token_frequencies

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 100, 250, 3, 3, 3, 9, 12, 61, 200, 5]]

pytestmark = pytest.mark.usefixtures("one_thread")


def _qwen2(num_layers: int, seed: int, vocab: int = 259, tied: bool = False, head_scale: float = 1.0):
    return tiny_qwen2(num_layers, seed, vocab_size=vocab, head_scale=head_scale, initializer_range=0.2,
                      tie_word_embeddings=tied, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def target():
    return tiny_model("target")


@pytest.fixture(scope="module")
def references(target):
    return [target_generate(target, torch.tensor([p]), max_new_tokens=30, eos_token_ids=[]).new_tokens.tolist()
            for p in PROMPTS]


KEPT = torch.tensor([0, 3, 5, 7, 42, 100, 200, 255, 256, 258])


# --- choosing the vocabulary ---------------------------------------------------------------------

def test_draft_vocabulary_picks_most_frequent_with_deterministic_ties():
    data = [[5, 5, 5, 2, 2, 9], [9, 9, 7, 1], []]
    # counts: 5 -> 3, 9 -> 3, 2 -> 2, 7 -> 1, 1 -> 1; ties broken by the lower id
    assert draft_vocabulary(data, 12, 3).tolist() == [2, 5, 9]
    assert draft_vocabulary(data, 12, 4).tolist() == [1, 2, 5, 9]  # 1 beats 7 (same count, lower id)
    # always-kept ids take their slots first
    assert draft_vocabulary(data, 12, 3, always=[11, 11]).tolist() == [5, 9, 11]
    # fewer distinct tokens than the size: filled with the lowest unused ids (frequency 0)
    assert draft_vocabulary(data, 12, 8).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]
    assert draft_vocabulary(data, 12, 12).tolist() == list(range(12))
    assert coverage(data, torch.tensor([5, 9]), 12) == pytest.approx(6 / 10)
    for bad in (0, 13):
        with pytest.raises(ValueError, match="size"):
            draft_vocabulary(data, 12, bad)
    with pytest.raises(ValueError, match="cannot hold"):
        draft_vocabulary(data, 12, 1, always=[1, 2])
    with pytest.raises(ValueError, match="outside"):
        draft_vocabulary([[12]], 12, 3)


def test_config_rejects_a_draft_vocab_size_below_one():
    assert DrafterConfig(draft_vocab_size=None).draft_vocab_size is None
    assert DrafterConfig(draft_vocab_size=32000).draft_vocab_size == 32000
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="drafter.draft_vocab_size"):
            DrafterConfig(draft_vocab_size=bad)


# --- the reduced head ----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_reduced_logits_equal_full_at_kept_ids_and_minus_inf_elsewhere(tied):
    model = _qwen2(1, seed=3, tied=tied)
    x = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    keep = torch.zeros(2, 9, dtype=torch.bool)
    keep[0, 4:], keep[1, 7:] = True, True
    with torch.no_grad():
        full, full_masked = model(x).logits, model(x, logits_to_keep=keep).logits
    embeddings = model.get_input_embeddings().weight.detach().clone()
    reduce_vocabulary(model, KEPT)
    head = reduced_head(model)
    assert isinstance(head, ReducedHead) and head.proj.weight.shape == (len(KEPT), 64)
    assert head.was_tied == tied and model.config.tie_word_embeddings is False
    assert torch.equal(draft_vocabulary_of(model), KEPT)
    outside = torch.ones(259, dtype=torch.bool)
    outside[KEPT] = False
    with torch.no_grad():
        for logits, reference in ((model(x).logits, full), (model(x, logits_to_keep=keep).logits, full_masked),
                                  (model(x, logits_to_keep=1).logits, full[:, -1:])):
            assert logits.shape == reference.shape
            torch.testing.assert_close(logits[..., KEPT], reference[..., KEPT], rtol=1e-5, atol=1e-5)
            assert torch.isneginf(logits[..., outside]).all()
    assert full_masked.shape == (7, 259)
    # untied: changing the head does not touch the input embeddings
    with torch.no_grad():
        head.proj.weight.add_(1.0)
    assert torch.equal(model.get_input_embeddings().weight, embeddings)
    # expand -> the full head again, kept rows from the reduced head
    expand_vocabulary(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.shape == (259, 64)
    torch.testing.assert_close(model.lm_head.weight[KEPT], head.proj.weight)
    assert model.config.tie_word_embeddings is False  # trained rows differ from the embeddings: stays untied


def test_reducing_a_tied_frozen_head_and_expanding_reties_it():
    model = _qwen2(1, seed=3, tied=True)
    reduce_vocabulary(model, KEPT)
    expand_vocabulary(model)
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_sampling_helpers_never_make_nan_from_minus_inf():
    model = reduce_vocabulary(_qwen2(1, seed=4), KEPT)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits[0]
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 50, 0.9), (0.3, 3, 0.5), (2.0, 300, 1.0), (0.0, 0, 1.0)):
        probs = process_logits(logits, temperature, top_k, top_p)
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(3))
        outside = torch.ones(259, dtype=torch.bool)
        outside[KEPT] = False
        assert (probs[:, outside] == 0).all()


def test_cache_and_generate_work(target):
    drafter = reduce_vocabulary(tiny_model("drafter", seed=1), KEPT)
    drafter.generation_config.eos_token_id = None  # min_new_tokens would suppress the EOS ids otherwise
    out = drafter.generate(torch.tensor([PROMPTS[0]]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                           max_new_tokens=12, min_new_tokens=12, do_sample=False)
    new = out[0, 5:]
    assert len(new) == 12 and all(int(t) in set(KEPT.tolist()) for t in new)
    mine = target_generate(drafter, torch.tensor([PROMPTS[0]]), max_new_tokens=12, eos_token_ids=[])
    assert mine.new_tokens.tolist() == new.tolist()


# --- speculative decoding stays exact ---------------------------------------------------------------

def test_greedy_speculative_with_reduced_drafter_equals_target(target, references):
    drafter = reduce_vocabulary(tiny_model("drafter", seed=1), KEPT)
    # the target itself, reduced to the tokens of its own greedy answers: drafts mostly accepted
    own = sorted({t for ref in references for t in ref} | {0})
    self_drafter = reduce_vocabulary(copy.deepcopy(target), torch.tensor(own))
    for prompt, reference in zip(PROMPTS, references):
        for model, k in ((drafter, 3), (self_drafter, 4)):
            out = speculative_generate(target, model, torch.tensor([prompt]), draft_length=k, max_new_tokens=30,
                                       eos_token_ids=[])
            assert out.new_tokens.tolist() == reference
        assert out.stats.acceptance_rate > 0.9
    # a drafter whose set misses the target's tokens: everything rejected, still the target's output
    missing = torch.tensor([i for i in range(259) if i not in set(own)][:20])
    out = speculative_generate(target, reduce_vocabulary(copy.deepcopy(target), missing), torch.tensor([PROMPTS[0]]),
                               draft_length=3, max_new_tokens=30, eos_token_ids=[])
    assert out.new_tokens.tolist() == references[0] and out.stats.acceptance_rate == 0.0


def test_int8_dynamic_quantized_reduced_drafter(target, references):
    drafter = reduce_vocabulary(tiny_model("drafter", seed=1), KEPT)
    quantized = quantize_drafter(drafter, "int8-dynamic")
    assert isinstance(reduced_head(quantized), ReducedHead)
    assert isinstance(reduced_head(quantized).proj, PerTokenDynamicLinear)
    assert isinstance(reduced_head(drafter).proj, torch.nn.Linear)  # the original is untouched
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        q, f = quantized(x).logits, drafter(x).logits
    outside = torch.ones(259, dtype=torch.bool)
    outside[KEPT] = False
    assert torch.isneginf(q[..., outside]).all() and torch.isfinite(q[..., KEPT]).all()
    assert (q[..., KEPT] - f[..., KEPT]).abs().max() < 0.1 * f[..., KEPT].abs().max()
    out = speculative_generate(target, quantized, torch.tensor([PROMPTS[0]]), draft_length=3, max_new_tokens=30,
                               eos_token_ids=[])
    assert out.new_tokens.tolist() == references[0]


def test_sampling_with_reduced_drafter_follows_target_distribution():
    """At temperature > 0 the first emitted token is distributed as the target's, although the drafter
    gives 3 of the 6 tokens probability 0 (the residual max(0, p - q) must supply them)."""
    num_runs, vocab, temperature = 1500, 6, 0.8
    small_target, small_drafter = _qwen2(2, 0, vocab, head_scale=4.0), _qwen2(1, 1, vocab, head_scale=4.0)
    kept = torch.tensor([0, 2, 3])
    reduce_vocabulary(small_drafter, kept)
    prompt = torch.tensor([[3]])
    with torch.no_grad():
        target_probs = torch.softmax(small_target(prompt).logits[0, -1] / temperature, -1)
        draft_probs = torch.softmax(small_drafter(prompt).logits[0, -1] / temperature, -1)
    assert (draft_probs[[1, 4, 5]] == 0).all() and target_probs[[1, 4, 5]].sum() > 0.05
    empirical = first_token_frequencies(small_target, small_drafter, prompt, vocab, num_runs, temperature)
    tv = 0.5 * (empirical - target_probs).abs().sum().item()
    assert 0.5 * (draft_probs - target_probs).abs().sum().item() > 0.2  # the drafter alone would be far off
    assert tv < 0.06
    chi_square = (num_runs * (empirical - target_probs) ** 2 / target_probs).sum().item()
    assert chi_square < 20.52  # chi-square, 5 degrees of freedom, p = 0.001


# --- save / load -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tied, trained", [(False, True), (True, False), (True, True)])
def test_save_load_round_trip(tmp_path, tied, trained):
    from distill.models.loading import load_model

    model = reduce_vocabulary(_qwen2(1, seed=5, tied=tied), KEPT)
    if trained:
        with torch.no_grad():
            reduced_head(model).proj.weight.mul_(1.5)
    save_drafter(model, tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / DRAFT_VOCAB_FILE).is_file()
    assert isinstance(reduced_head(model), ReducedHead)  # saving leaves the model reduced
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        expected = model(x).logits
        for loaded in (load_drafter(tmp_path), load_model(str(tmp_path))[0]):
            assert isinstance(reduced_head(loaded), ReducedHead)
            assert torch.equal(draft_vocabulary_of(loaded), KEPT)
            assert torch.equal(loaded(x).logits, expected)
        # plain transformers: a full-vocabulary model whose kept rows are the reduced head's
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert type(plain.lm_head) is torch.nn.Linear and plain.lm_head.weight.shape == (259, 64)
        torch.testing.assert_close(plain.lm_head.weight[KEPT], reduced_head(model).proj.weight)
        assert plain.config.tie_word_embeddings == (tied and not trained)
        torch.testing.assert_close(plain(x).logits[..., KEPT], expected[..., KEPT], rtol=1e-5, atol=1e-5)
    # a file for another model is refused
    other = _qwen2(1, seed=5, vocab=300)
    with pytest.raises(ValueError, match="another model"):
        apply_saved_draft_vocab(other, tmp_path)


# --- training --------------------------------------------------------------------------------------

def _examples(n=8, vocab=259):
    g = torch.Generator().manual_seed(1)

    def ids(lo, hi):
        return torch.randint(1, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": ids(3, 8), "completion_ids": ids(5, 15)} for _ in range(n)]


def test_restrict_logits_maps_labels_and_drops_unknown_ones():
    ids = torch.tensor([1, 4, 6])
    student, target = torch.randn(1, 3, 8), torch.randn(1, 3, 7)
    labels, mask = torch.tensor([[4, 5, 6]]), torch.ones(1, 3, dtype=torch.bool)
    s, t, lab, m = restrict_logits(student, target, ids, labels=labels, mask=mask)
    assert torch.equal(s, student[..., ids]) and torch.equal(t, target[..., ids])
    assert lab.tolist() == [[1, 0, 2]] and m.tolist() == [[True, False, True]]
    s, t, lab, m = restrict_logits(student, target, torch.tensor([1, 7]))  # 7 is past the target's vocabulary
    assert s.shape == (1, 3, 1) and lab is None and m is None


@pytest.mark.parametrize("method", ["full", "lora"])
def test_training_a_reduced_drafter(tmp_path, target, method):
    examples = _examples()
    if method == "full":
        drafter = build_drafter(tiny_model("drafter", seed=1), init="sibling")
    else:
        drafter = build_drafter(tiny_model("target"), init="layers", num_layers=1, lora=LoraSettings(r=4, alpha=8))
    completions = [ex["completion_ids"] for ex in examples]
    ids = draft_vocabulary(completions, 259, 64, always=[256, 258])
    reduce_vocabulary(drafter, ids)
    head = reduced_head(drafter)
    assert head.proj.weight.shape == (64, 64)
    assert head.proj.weight.requires_grad == (method == "full")
    before = head.proj.weight.detach().clone()
    metrics = train_drafter(drafter, target, examples, loop_settings(loss="fkl", lr=1e-2, max_steps=3, batch_size=4),
                            val_examples=examples[:2], output_dir=tmp_path, progress=False)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items()
               if k in ("final_loss", "val_loss_before", "val_loss_after"))
    assert 0.0 <= metrics["val_expected_acceptance_after"] <= 1.0
    assert not torch.equal(head.proj.weight, before) if method == "full" else torch.equal(head.proj.weight, before)
    merged = merge_drafter(drafter)
    assert isinstance(reduced_head(merged), ReducedHead) and reduced_head(merged).proj.weight.shape == (64, 64)
    with torch.no_grad():
        logits = merged(torch.tensor([PROMPTS[0]])).logits
    outside = torch.ones(259, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[..., outside]).all()
    # the cross-entropy loss runs too (labels outside the set are skipped, not infinite)
    merged.requires_grad_(True)
    metrics = train_drafter(merged.train(), target, examples,
                            loop_settings(loss="ce", lr=1e-3, max_steps=1, batch_size=4), output_dir=tmp_path / "ce",
                            progress=False)
    assert torch.isfinite(torch.tensor(metrics["final_loss"]))


def test_stored_top_k_step_on_draft_columns_equals_the_full_logits_loss(target):
    """The training step against stored top-k reads a reduced drafter's (N, D) logits; its loss, gradient and
    agreement equal those of the full (N, V) logits, and the head returns full logits again afterwards."""
    from distill.training.loop import LossSpec, _stored_top_k_loss_step
    from distill.training.losses import top_k_distillation_loss
    drafter = build_drafter(tiny_model("drafter", seed=1), init="sibling")
    reduce_vocabulary(drafter, KEPT)
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 259, (2, 9), generator=gen)
    keep = torch.zeros(2, 9, dtype=torch.bool)
    keep[:, 4:] = True
    with torch.no_grad():
        target_logp = torch.log_softmax(target(input_ids).logits[keep], -1)
    top_logp, top_ids = target_logp.topk(8, dim=-1)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": keep,
             "labels": top_ids[:, 0].new_zeros(2, 9).masked_scatter(keep, top_ids[:, 0]),
             "top_k_ids": top_ids, "top_k_logprobs": top_logp}
    spec = LossSpec(kind="fkl", jsd_beta=0.5, temperature=1.0)
    loss, accept, agree = _stored_top_k_loss_step(drafter, {k: batch[k] for k in ("input_ids", "attention_mask")},
                                                  batch, spec)
    loss.backward()
    grad = reduced_head(drafter).proj.weight.grad.clone()
    drafter.zero_grad()
    full = drafter(input_ids, attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
    assert full.shape[-1] == 259  # full logits again outside the block
    reference, reference_accept = top_k_distillation_loss(full, top_ids, top_logp, kind="fkl")
    reference.mean().backward()
    torch.testing.assert_close(loss, reference.mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(accept, reference_accept.sum().item(), rtol=0, atol=1e-4)
    assert agree == float((full.argmax(-1) == top_ids[:, 0]).sum())
    torch.testing.assert_close(grad, reduced_head(drafter).proj.weight.grad, rtol=0, atol=1e-5)


# --- the pipeline -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_pipeline_with_reduced_vocabulary(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "distill.cli", "pipeline", "experiment=tiny",
                           f"outputs={tmp_path}/outputs", "drafter.draft_vocab_size=64", "distill.max_steps=3",
                           "evaluate.timed_drafters=all"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report_path = Path(proc.stdout.strip().splitlines()[-1])
    report = json.loads(report_path.read_text())
    assert report["outputs_match_target"] is True  # greedy, fp32: lossless with 64 of 259 tokens
    # the undistilled baseline is measured with the same 64-token head, so only training differs
    assert report["baseline_drafter"]["draft_vocab_size"] == 64
    assert report["baseline_drafter"]["outputs_match_target"] is True
    assert "64-token draft vocabulary" in (report_path.parent / "report.md").read_text()
    run = report_path.parent.parent
    manifest = json.loads((run / "distill" / "manifest.json").read_text())
    assert manifest["draft_vocab"]["size"] == 64 and 0.5 < manifest["draft_vocab"]["coverage"] <= 1.0
    assert (run / "distill" / "drafter" / DRAFT_VOCAB_FILE).is_file()
    export = run / "export" / "drafter-hf"
    assert (export / DRAFT_VOCAB_FILE).is_file()
    card = (export / "README.md").read_text()
    assert "Reduced draft vocabulary" in card and "full-vocabulary" in card and "GGUF" in card
    assert isinstance(reduced_head(load_drafter(export)), ReducedHead)
    assert type(AutoModelForCausalLM.from_pretrained(export).lm_head) is torch.nn.Linear


def test_resume_from_a_reduced_checkpoint(tmp_path, target):
    examples = _examples()
    ids = draft_vocabulary([ex["completion_ids"] for ex in examples], 259, 48, always=[256, 258])

    def fresh():
        return reduce_vocabulary(build_drafter(tiny_model("drafter", seed=1), init="sibling"), ids)

    args = dict(loss="fkl", lr=1e-2, batch_size=4)
    whole = fresh()
    train_drafter(whole, target, examples, loop_settings(max_steps=2, checkpoint_every=1, **args),
                  output_dir=tmp_path / "a",
                  progress=False)
    resumed = fresh()
    train_drafter(resumed, target, examples, loop_settings(max_steps=2, **args), output_dir=tmp_path / "b",
                  resume_from=tmp_path / "a" / "checkpoint-1", progress=False)
    torch.testing.assert_close(reduced_head(resumed).proj.weight, reduced_head(whole).proj.weight)
