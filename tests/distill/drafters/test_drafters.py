"""Drafter construction (distill/drafters/build.py) on tiny random Qwen2 models."""

import pytest
import torch
from tiny_models import tiny_qwen2
from transformers import DynamicCache, Qwen2ForCausalLM

from distill.drafters.build import (
    LoraSettings,
    build_drafter,
    count_parameters,
    describe_layers,
    merge_drafter,
    select_layers,
)

VOCAB = 300


pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_qwen2(num_layers: int, seed: int = 0) -> Qwen2ForCausalLM:
    return tiny_qwen2(num_layers, seed, vocab_size=VOCAB, max_position_embeddings=128,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def base():
    return _tiny_qwen2(6)


@pytest.fixture
def input_ids():
    return torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))


def test_select_layers():
    assert select_layers(6, 3, "first") == [0, 1, 2]
    assert select_layers(6, 3, "even") == [0, 2, 5]
    assert select_layers(24, 4, "even") == [0, 7, 15, 23]
    assert select_layers(6, 1, "even") == [0]
    assert select_layers(6, 6, "even") == list(range(6))
    with pytest.raises(ValueError, match="num_layers"):
        select_layers(6, 7)
    with pytest.raises(ValueError, match="layer_selection"):
        select_layers(6, 2, "last")


def test_even_layers_copies_the_right_layers(base):
    drafter = build_drafter(base, init="layers", num_layers=3, layer_selection="even")
    assert drafter.config.num_hidden_layers == 3 and len(drafter.config.layer_types) == 3
    assert len(drafter.model.layers) == 3
    for new_idx, old_idx in enumerate([0, 2, 5]):
        layer = drafter.model.layers[new_idx]
        assert layer.self_attn.layer_idx == new_idx
        assert torch.equal(layer.mlp.up_proj.weight, base.model.layers[old_idx].mlp.up_proj.weight)
        assert layer.mlp.up_proj.weight.data_ptr() != base.model.layers[old_idx].mlp.up_proj.weight.data_ptr()
    assert torch.equal(drafter.lm_head.weight, base.lm_head.weight)
    # the base model is untouched
    assert base.config.num_hidden_layers == 6 and len(base.model.layers) == 6
    assert [layer.self_attn.layer_idx for layer in base.model.layers] == list(range(6))
    trainable, total = count_parameters(drafter)
    assert trainable == total and drafter.training


def test_explicit_layers_keep_exactly_those(base, input_ids):
    drafter = build_drafter(base, init="layers", layers=[0, 1, 5], num_layers=99, layer_selection="even")
    assert drafter.config.num_hidden_layers == 3 and len(drafter.config.layer_types) == 3
    for new_idx, old_idx in enumerate([0, 1, 5]):
        layer = drafter.model.layers[new_idx]
        assert layer.self_attn.layer_idx == new_idx
        assert torch.equal(layer.self_attn.q_proj.weight, base.model.layers[old_idx].self_attn.q_proj.weight)
    # all layers listed = the base model itself
    whole = build_drafter(base, init="layers", layers=list(range(6))).eval()
    with torch.no_grad():
        assert torch.equal(whole(input_ids).logits, base(input_ids).logits)
    for bad in ([0, 6], [2, 1], [1, 1], []):
        with pytest.raises(ValueError, match=r"0\.\.5"):
            build_drafter(base, init="layers", layers=bad)
    with pytest.raises(ValueError, match="init='layers'"):
        build_drafter(base, init="sibling", layers=[0])


def test_describe_layers():
    assert describe_layers(4) == "first 4 layers"
    assert describe_layers(4, "even") == "4 evenly spaced layers"
    assert describe_layers(12, "first", [0, 1, 2, *range(15, 24)]) == "12 layers [0-2, 15-23]"
    assert describe_layers(4, "first", [0, 5, 7, 8]) == "4 layers [0, 5, 7-8]"
    assert describe_layers(1) == "first 1 layer" and describe_layers(1, "first", [3]) == "1 layer [3]"


def test_all_layers_reproduce_the_base(base, input_ids):
    drafter = build_drafter(base, init="layers", num_layers=6).eval()
    with torch.no_grad():
        assert torch.equal(drafter(input_ids).logits, base(input_ids).logits)


def test_cut_model_runs_with_cache_and_generate(base, input_ids):
    drafter = build_drafter(base, init="layers", num_layers=2, layer_selection="even").eval()
    with torch.no_grad():
        full = drafter(input_ids).logits
        cache = DynamicCache(config=drafter.config)
        prefill = drafter(input_ids[:, :4], cache=cache, use_cache=True)
        assert prefill.cache is cache and len(cache.layers) == 2  # one slot per kept layer
        steps = [prefill.logits]
        for t in range(4, input_ids.shape[1]):
            steps.append(drafter(input_ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
        assert cache.get_seq_length() == input_ids.shape[1]

        out = drafter.generate(input_ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        ids = input_ids
        for _ in range(6):  # greedy without cache, one full forward per token
            ids = torch.cat([ids, drafter(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


def test_lora_trains_only_adapters_and_merges_exactly(input_ids):
    model = _tiny_qwen2(2, seed=1)
    drafter = build_drafter(model, init="sibling", lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    names = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert any("q_proj" in n for n in names) and any("down_proj" in n for n in names)
    trainable, total = count_parameters(drafter)
    assert 0 < trainable < total / 5
    with torch.no_grad():  # LoRA starts as the identity (B = 0): give the adapters a value
        for n, p in drafter.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    drafter.eval()
    with torch.no_grad():
        peft_logits = drafter(input_ids).logits
        merged = merge_drafter(drafter)
        assert type(merged) is Qwen2ForCausalLM
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        merged_logits = merged(input_ids).logits
        assert not torch.allclose(peft_logits, _tiny_qwen2(2, seed=1)(input_ids).logits, atol=1e-3)
    assert torch.allclose(merged_logits, peft_logits, atol=1e-5)


def test_lora_on_cut_layers(base):
    drafter = build_drafter(base, init="layers", num_layers=2, lora=LoraSettings(r=2))
    assert drafter.base_model.model.config.num_hidden_layers == 2
    merged = merge_drafter(drafter)
    assert merged.config.num_hidden_layers == 2 and merge_drafter(merged) is merged


def test_bad_settings(base):
    with pytest.raises(ValueError, match="r must"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ValueError, match="num_layers"):
        build_drafter(base, init="sibling", num_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        build_drafter(base, init="layers")
    with pytest.raises(ValueError, match="num_layers"):
        build_drafter(base, init="layers", num_layers=7)
    with pytest.raises(ValueError, match="init"):
        build_drafter(base, init="random")
