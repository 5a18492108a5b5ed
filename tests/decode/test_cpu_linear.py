"""decode.cpu_linear (oneDNN float32 linear layers) and the decode loop's own cost per block, on tiny models."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import decode.speculative as speculative
from decode.cpu_linear import OneDNNLinear, onednn_linear_available, use_onednn_linear
from decode.quantization import PerTokenDynamicLinear, drafter_for_decoding, quantize_drafter
from decode.speculative import speculative_generate, target_generate
from tests.decode.test_speculative import PROMPTS, tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN")]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 7, 64), (1, 1, 64)])
def test_onednn_linear_equals_torch_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    ours = OneDNNLinear(linear)(x)
    assert ours.shape == (*shape[:-1], 96)
    torch.testing.assert_close(ours, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    # greedy verification over K + 1 rows must give each row what a one-token forward gives it
    torch.manual_seed(0)
    layer = OneDNNLinear(nn.Linear(896, 4864))
    x = torch.randn(16, 896)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    for rows in (2, 4, 5, 8, 16):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_use_onednn_linear_swaps_float32_linears_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                          nn.Linear(8, 8).to(torch.bfloat16))
    assert use_onednn_linear(model) == 2
    assert [type(m).__name__ for m in (model[0], model[1][0], model[2])] == ["OneDNNLinear", "OneDNNLinear", "Linear"]
    assert use_onednn_linear(model) == 0  # nothing left to swap


def test_int8_layers_are_left_alone():
    quantized = quantize_drafter(tiny_model(1, seed=1), "int8-dynamic")
    assert use_onednn_linear(quantized) == 0
    assert any(isinstance(m, PerTokenDynamicLinear) for m in quantized.modules())


def test_drafter_for_decoding_unquantized_swaps_in_place():
    drafter = tiny_model(1, seed=1)
    assert drafter_for_decoding(drafter, "none") is drafter
    assert isinstance(drafter.lm_head, OneDNNLinear)
    assert not any(type(m) is nn.Linear for m in drafter.modules())


@pytest.fixture(scope="module")
def onednn_pair():
    target, drafter = tiny_model(2, seed=0), tiny_model(1, seed=1)
    references = [target_generate(target, torch.tensor([p]), max_new_tokens=40, eos_token_ids=[]).new_tokens
                  for p in PROMPTS]
    use_onednn_linear(target)
    use_onednn_linear(drafter)
    return target, drafter, references


def test_greedy_speculative_output_is_the_targets_with_onednn(onednn_pair):
    target, drafter, torch_references = onednn_pair
    for prompt, torch_reference in zip(PROMPTS, torch_references):
        alone = target_generate(target, torch.tensor([prompt]), max_new_tokens=40, eos_token_ids=[]).new_tokens
        assert alone.tolist() == torch_reference.tolist()  # the tiny model's argmax has no near-ties
        for k in (1, 3, 5):
            out = speculative_generate(target, drafter, torch.tensor([prompt]), draft_length=k, max_new_tokens=40,
                                       eos_token_ids=[])
            assert out.new_tokens.tolist() == alone.tolist(), (prompt, k)


def test_the_loop_costs_little_beyond_its_forwards(monkeypatch):
    """The decode loop's own work per block (cache crops, host syncs, logits processing, bookkeeping) is a
    small fraction of the time its model forwards take: the ratio that a per-block slowdown shows up in.

    A drafter equal to the target (every draft accepted) makes long blocks; models are 4 layers wide enough
    that a forward costs more than Python's per-call noise.
    """
    target = tiny_model(4, seed=0)
    drafter = copy.deepcopy(target)
    forward_s = 0.0
    original = speculative.forward

    def timed(model, input_ids, cache, last_only=False):
        nonlocal forward_s
        start = time.perf_counter()
        logits = original(model, input_ids, cache, last_only)
        forward_s += time.perf_counter() - start
        return logits

    monkeypatch.setattr(speculative, "forward", timed)
    prompt = torch.tensor([PROMPTS[2]])
    speculative_generate(target, drafter, prompt, draft_length=4, max_new_tokens=8, eos_token_ids=[])  # warm-up
    ratios = []
    for _ in range(3):
        forward_s = 0.0
        out = speculative_generate(target, drafter, prompt, draft_length=4, max_new_tokens=120, eos_token_ids=[])
        loop_forward_s = forward_s - out.stats.prefill_s  # the prefill's forwards are timed outside decode_s
        ratios.append((out.stats.decode_s - loop_forward_s) / loop_forward_s)
    assert out.stats.acceptance_rate == 1.0 and len(out.stats.accepted_per_block) == 24
    assert min(ratios) < 0.25, ratios


def test_a_head_tied_to_the_embedding_is_left_alone():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert use_onednn_linear(model) == 7  # q, k, v, o, gate, up, down; not the tied head
    assert type(model.lm_head) is nn.Linear


def test_the_target_alone_baseline_times_its_prefill_without_autograd(monkeypatch):
    """transformers' generate prefills under no_grad; a separately timed prefill with autograd on costs ~2.7x in
    float32 on a CPU, and subtracting it made the target alone look faster than it is."""
    import decode.benchmark as benchmark

    modes = []
    real = benchmark.prefill

    def spy(model, ids):
        modes.append(torch.is_inference_mode_enabled() or not torch.is_grad_enabled())
        return real(model, ids)

    monkeypatch.setattr(benchmark, "prefill", spy)
    model = tiny_model(num_layers=2, seed=0)
    prompts = [("p0", "code", PROMPTS[0])]
    outputs = benchmark.run_target_alone(model, prompts, max_new_tokens=4, eos_token_ids=[], engine="hf",
                                         progress=False)
    assert modes and all(modes) and outputs[0].stats.decode_s > 0
