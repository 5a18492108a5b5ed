"""Adaptive draft lengths, confidence stopping, stop strings and the benchmark's baselines, on tiny models."""

import warnings

import pytest
import torch

from decode.benchmark import benchmark, run_target_alone
from decode.costs import measure_verify_costs, monotone_verify_costs
from decode.speculative import speculative_generate, target_generate
from decode.stopping import StopStrings
from distill.models.tiny import tiny_tokenizer
from tests.decode.test_speculative import PROMPTS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
BYTES = 259  # the tiny byte tokenizer's vocabulary, so every token decodes


@pytest.fixture(scope="module")
def target():
    return tiny_model(2, seed=0, vocab_size=BYTES)


@pytest.fixture(scope="module")
def drafter():
    return tiny_model(1, seed=1, vocab_size=BYTES)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def reference(target, prompt, n=40, **kwargs):
    return target_generate(target, torch.tensor([prompt]), max_new_tokens=n, eos_token_ids=[], **kwargs)


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.9])
def test_adaptive_drafting_keeps_greedy_output(target, drafter, schedule, threshold):
    for prompt in PROMPTS:
        expected = reference(target, prompt).new_tokens
        for draft in (drafter, target):
            out = speculative_generate(target, draft, torch.tensor([prompt]), draft_length=2, max_new_tokens=40,
                                       eos_token_ids=[], schedule=schedule, confidence_threshold=threshold)
            assert torch.equal(out.new_tokens, expected)
            assert sum(out.stats.accepted_per_block) + len(out.stats.accepted_per_block) >= out.stats.new_tokens


def test_heuristic_schedule_grows_with_a_perfect_drafter(target):
    out = speculative_generate(target, target, torch.tensor([PROMPTS[0]]), draft_length=2, max_new_tokens=60,
                               eos_token_ids=[], schedule="heuristic")
    assert out.stats.drafted_per_block[:3] == [2, 4, 6]  # +2 after each fully accepted block
    assert len(out.stats.per_position_acceptance) == max(out.stats.drafted_per_block)
    capped = speculative_generate(target, target, torch.tensor([PROMPTS[0]]), draft_length=2, max_new_tokens=60,
                                  eos_token_ids=[], schedule="heuristic", max_draft_length=5)
    assert max(capped.stats.drafted_per_block) == 5


def test_confidence_threshold_shortens_blocks(target, drafter):
    kwargs = dict(draft_length=6, max_new_tokens=40, eos_token_ids=[])
    free = speculative_generate(target, drafter, torch.tensor([PROMPTS[2]]), **kwargs)
    strict = speculative_generate(target, drafter, torch.tensor([PROMPTS[2]]), **kwargs, confidence_threshold=0.99)
    assert strict.stats.draft_forwards < free.stats.draft_forwards
    assert min(strict.stats.drafted_per_block[:-1]) >= 1  # the low-confidence token is still proposed (the last block may be cut by max_new_tokens)
    assert torch.equal(strict.new_tokens, free.new_tokens)


def test_confidence_threshold_with_sampling_is_seeded(target, drafter):
    def run():
        return speculative_generate(target, drafter, torch.tensor([PROMPTS[0]]), draft_length=4, max_new_tokens=30,
                                    eos_token_ids=[], temperature=0.8, confidence_threshold=0.5,
                                    generator=torch.Generator().manual_seed(3)).new_tokens
    assert torch.equal(run(), run())


def ascii_stop(tokens: list[int], start: int) -> str:
    """Two consecutive printable-ASCII tokens of the (random-byte) output from ``start`` on, as text.

    ASCII bytes decode to themselves wherever they sit; random non-ASCII bytes decode to U+FFFD.
    """
    printable = [i for i in range(start, len(tokens) - 1) if all(32 <= t < 127 for t in tokens[i:i + 2])]
    i = printable[0] if printable else next(i for i in range(start, len(tokens)) if 32 <= tokens[i] < 127)
    return bytes(tokens[i:i + 2] if printable else tokens[i:i + 1]).decode()


def test_stop_strings_match_token_by_token_decoding(target, drafter, tokenizer):
    """The stop lands where the target decoding alone stops; nothing after the completing token."""
    for prompt in PROMPTS:
        full = reference(target, prompt).new_tokens.tolist()
        stop = ascii_stop(full, 5)  # a piece of what the target writes, spanning two tokens
        first = next(i for i in range(len(full)) if stop in tokenizer.decode(full[: i + 1]))
        alone = reference(target, prompt, stop_strings=[stop], tokenizer=tokenizer).new_tokens.tolist()
        assert alone == full[: first + 1]
        for k in (1, 3, 5):
            out = speculative_generate(target, drafter, torch.tensor([prompt]), draft_length=k, max_new_tokens=40,
                                       eos_token_ids=[], stop_strings=[stop, "never appears \x00"],
                                       tokenizer=tokenizer)
            assert out.new_tokens.tolist() == alone
            assert tokenizer.decode(out.new_tokens.tolist()).endswith(stop)


def test_stop_strings_need_a_tokenizer(target, drafter):
    with pytest.raises(ValueError, match="tokenizer"):
        speculative_generate(target, drafter, torch.tensor([PROMPTS[0]]), draft_length=2, max_new_tokens=4,
                             eos_token_ids=[], stop_strings=["x"])
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""], tiny_tokenizer())


def test_stop_string_window_finds_late_stops(tokenizer):
    tokens = list(("a" * 200 + "STOP here").encode())
    assert StopStrings(["STOP"], tokenizer).first_stop(tokens, 0) == 203
    assert StopStrings(["STOP"], tokenizer).first_stop(tokens[:203], 0) is None


@pytest.mark.parametrize("kwargs", [dict(confidence_threshold=1.0), dict(confidence_threshold=-0.1),
                                    dict(schedule="fast"), dict(schedule="heuristic", max_draft_length=1)])
def test_bad_drafting_arguments_raise(target, drafter, kwargs):
    with pytest.raises(ValueError):
        speculative_generate(target, drafter, torch.tensor([PROMPTS[0]]), draft_length=2, max_new_tokens=4,
                             eos_token_ids=[], **kwargs)


# --- benchmark ------------------------------------------------------------------------------------------

def test_hf_engine_target_alone_equals_our_loop(target, tokenizer):
    prompts = [("a", "code", PROMPTS[0]), ("b", "chat", PROMPTS[2])]
    hf = run_target_alone(target, prompts, max_new_tokens=20, eos_token_ids=[], engine="hf", progress=False)
    loop = run_target_alone(target, prompts, max_new_tokens=20, eos_token_ids=[], engine="loop", progress=False)
    for a, b in zip(hf, loop):
        assert torch.equal(a.new_tokens, b.new_tokens)
        assert a.stats.new_tokens == 20 and a.stats.decode_s > 0 and a.stats.prefill_s > 0
    with pytest.raises(ValueError, match="engine"):
        run_target_alone(target, prompts, max_new_tokens=2, eos_token_ids=[], engine="vllm")


def test_benchmark_reports_choice_of_k_and_cost_model(target, drafter):
    prompts = [("a", "code", PROMPTS[0]), ("b", "chat", PROMPTS[1])]
    result = benchmark(target, drafter, prompts, draft_length=3, max_new_tokens=16, eos_token_ids=[], progress=False)
    assert result["outputs_match_target"] is True
    assert result["baselines"]["target"]["engine"] == "transformers generate"
    assert result["baselines"]["hf_assisted"]["outputs_match_target"] is True
    assert result["baselines"]["hf_assisted"]["ours_over_hf"] > 0
    choice = result["draft_length_choice"]
    assert 1 <= choice["best_draft_length"] <= 8 and choice["rule_of_thumb"] >= 2
    assert result["verify_costs"][0] == 1.0 and len(result["verify_costs"]) == 9
    assert result["measured_over_theoretical"] == pytest.approx(result["speedup"] / result["theoretical_speedup"])
    assert result["cost_model_speedup"] > 0 and result["per_category"]["chat"]["draft_length_choice"]


def test_benchmark_heuristic_and_auto_schedules(target, drafter, tokenizer):
    prompts = [("a", "code", PROMPTS[0]), ("b", "chat", PROMPTS[2])]
    heuristic = benchmark(target, target, prompts, draft_length=2, max_new_tokens=30, eos_token_ids=[],
                          schedule="heuristic", progress=False)
    assert heuristic["outputs_match_target"] is True and heuristic["mean_draft_length"] > 2
    assert heuristic["baselines"]["hf_assisted"]["outputs_match_target"] is True
    auto = benchmark(target, drafter, prompts, draft_length=2, max_new_tokens=16, eos_token_ids=[],
                     schedule="auto", max_draft_length=4, progress=False)
    assert auto["schedule"]["name"] == "auto"
    assert auto["draft_length"] == auto["auto_draft_length"]["best_draft_length"]
    assert auto["auto_draft_length"]["calibration_draft_length"] == 4
    assert auto["outputs_match_target"] is True


def test_benchmark_stop_strings_across_decoders(target, drafter, tokenizer):
    full = reference(target, PROMPTS[0], 30).new_tokens.tolist()
    stop = ascii_stop(full, 3)
    result = benchmark(target, drafter, [("a", "code", PROMPTS[0])], draft_length=3, max_new_tokens=30,
                       eos_token_ids=[], stop_strings=[stop], tokenizer=tokenizer, progress=False)
    assert result["outputs_match_target"] is True
    assert result["new_tokens"] < 30
    assert result["baselines"]["hf_assisted"]["new_tokens"] == result["new_tokens"]


def test_measure_verify_costs(target):
    costs = measure_verify_costs(target, [PROMPTS[0], PROMPTS[1]], 4, repeats=2)
    assert len(costs) == 4 and costs[0] == 1.0 and all(c > 0 for c in costs)


@pytest.mark.parametrize("raw, smooth", [
    ([1.0, 0.9, 1.1, 1.0, 1.3], [1.0, 1.0, 1.05, 1.05, 1.3]),  # nothing below the unit
    ([1.0, 1.2, 1.1, 1.0, 2.0], [1.0, 1.1, 1.1, 1.1, 2.0]),
    ([1.0, 1.0, 1.5, 1.6], [1.0, 1.0, 1.5, 1.6]),  # already non-decreasing: unchanged
    ([1.0], [1.0]),
    ([], []),
])
def test_monotone_verify_costs_pool_the_dips_and_keep_the_steps(raw, smooth):
    assert monotone_verify_costs(raw) == pytest.approx(smooth)


def test_benchmark_reuses_given_verify_costs_and_measures_them_otherwise(target, drafter):
    args = dict(draft_length=2, max_new_tokens=8, eos_token_ids=[], hf_assisted=False, progress=False)
    measured = benchmark(target, drafter, [("a", "code", PROMPTS[0])], **args)
    assert measured["verify_costs"] == monotone_verify_costs(measured["verify_costs_measured"])
    given = [1.0 + 0.1 * n for n in range(17)]
    reused = benchmark(target, drafter, [("a", "code", PROMPTS[0])], **args, verify_costs=given)
    assert reused["verify_costs"] == given and reused["verify_costs_measured"] is None
    assert reused["verify_cost"] == pytest.approx(given[2])  # K + 1 = 3 tokens


# --- drafter quantization ------------------------------------------------------------------------------

def test_int8_drafter_keeps_output_and_leaves_the_original(target, drafter):
    from decode.quantization import PerTokenDynamicLinear, quantize_drafter, resolve_quantization

    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    quantized = quantize_drafter(drafter, "auto")
    assert resolve_quantization("auto", torch.device("cpu")) == "int8-dynamic"
    assert quantized is not drafter and any("quantized" in type(m).__module__ for m in quantized.modules())
    linears = [m for m in quantized.modules() if isinstance(m, PerTokenDynamicLinear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert all(m.weight().qscheme() == torch.per_channel_affine for m in linears)  # per output channel
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    assert quantize_drafter(drafter, "none") is drafter
    for prompt in PROMPTS:
        out = speculative_generate(target, quantized, torch.tensor([prompt]), draft_length=3, max_new_tokens=30,
                                   eos_token_ids=[])
        assert torch.equal(out.new_tokens, reference(target, prompt, 30).new_tokens)
    # int8 drafts stay close to the fp32 drafter's: most greedy drafts agree
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        agree = (quantized(ids).logits.argmax(-1) == drafter(ids).logits.argmax(-1)).float().mean().item()
    assert agree > 0.8
    with pytest.raises(ValueError, match="drafter quantization"):
        quantize_drafter(drafter, "int4")


@pytest.mark.parametrize("bias", [True, False])
def test_per_token_int8_linear_survives_a_massive_activation(bias):
    """One token with activations 300x the others (as on a Qwen prompt's first token) must not crush
    the other tokens: torch's per-tensor dynamic Linear loses them, the per-token one keeps them."""
    from decode.quantization import PerTokenDynamicLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=bias)
    x = torch.randn(2, 5, 64)
    x[:, 0] *= 300
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        per_tensor = torch.ao.nn.quantized.dynamic.Linear.from_float(_with_qconfig(layer))
        per_token = PerTokenDynamicLinear.from_float(_with_qconfig(layer))
        reference, quiet = layer(x), layer(x)[:, 1:]
        scale = quiet.abs().max().item()
        assert (per_tensor(x)[:, 1:] - quiet).abs().max().item() > 0.5 * scale
        assert (per_token(x)[:, 1:] - quiet).abs().max().item() < 0.05 * scale
        assert (per_token(x) - reference).abs().max().item() < 0.05 * reference.abs().max().item()
        # one token at a time is torch's layer itself
        assert torch.equal(per_token(x[:1, 1:2]), per_tensor(x[:1, 1:2]))
        # a state dict round trip keeps the bias the per-token path adds back
        fresh = PerTokenDynamicLinear(64, 32, bias_=bias)
        fresh.load_state_dict(per_token.state_dict())
        assert torch.equal(fresh(x), per_token(x))
    assert "PerToken" in repr(per_token)


def _with_qconfig(layer):
    layer.qconfig = torch.ao.quantization.default_dynamic_qconfig
    return layer


def test_int8_drafter_prefill_matches_token_by_token(drafter):
    """Inside a transformers model (3-D inputs, a KV cache) the multi-token prompt forward of the int8
    drafter gives the logits that one-token steps give."""
    from transformers import DynamicCache

    from decode.quantization import quantize_drafter

    quantized = quantize_drafter(drafter, "int8-dynamic")
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        whole = quantized(ids).logits[0]
        cache, steps = DynamicCache(), []
        for i in range(ids.shape[1]):
            steps.append(quantized(ids[:, i:i + 1], cache=cache, use_cache=True).logits[0, -1])
    steps = torch.stack(steps)
    # int8 rounding differs a little between the two paths (measured 2.3% of the largest logit)
    assert (whole - steps).abs().max() < 0.05 * whole.abs().max()


def test_hf_assisted_defaults_on_tiny_models(target, drafter):
    from decode.benchmark import hf_assisted_defaults

    before = drafter.generation_config.to_dict()
    result = hf_assisted_defaults(target, drafter, [("a", "code", PROMPTS[0])], max_new_tokens=12,
                                  eos_token_ids=[], progress=False)
    assert result["new_tokens"] == 12 and result["tokens_per_s"] > 0
    assert drafter.generation_config.to_dict() == before  # transformers' tuning does not leak into later runs


def test_side_by_side_cost_ratios_are_medians_of_interleaved_rounds(target, drafter):
    from decode.costs import measure_cost_ratios

    costs = measure_cost_ratios(target, {"small": drafter, "itself": target}, PROMPTS[:2], rounds=3, max_rounds=3,
                                repeats=2)
    assert set(costs["cost_ratios"]) == set(costs["cost_ratio_range"]) == {"small", "itself"}
    assert costs["rounds"] == 3 and costs["prompts"] == 2 and costs["target_forward_ms"] > 0
    for name, c in costs["cost_ratios"].items():
        lo, hi = costs["cost_ratio_range"][name]
        assert 0 < lo <= c <= hi  # the median round lies inside the rounds' range
    lo, hi = costs["cost_ratio_range"]["itself"]
    assert lo < 2 and hi > 0.5  # the target timed against itself: c about 1
    with pytest.raises(ValueError):
        measure_cost_ratios(target, {}, PROMPTS[:1])


def test_drafters_of_the_same_shapes_share_one_cost_ratio(target, drafter):
    """A drafter with other weights but the same modules and shapes (a LoRA-merged drafter beside its base)
    runs the same kernels: one c for both, from their pooled rounds; another shape keeps its own."""
    import copy

    from decode.costs import cost_signature, measure_cost_ratios
    from decode.quantization import drafter_for_decoding

    trained = copy.deepcopy(drafter)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    assert cost_signature(trained) == cost_signature(drafter) != cost_signature(target)
    int8 = drafter_for_decoding(copy.deepcopy(drafter), "int8-dynamic")
    assert cost_signature(int8) != cost_signature(drafter)  # other kernels
    int8_trained = drafter_for_decoding(copy.deepcopy(trained), "int8-dynamic")
    assert cost_signature(int8_trained) == cost_signature(int8)
    costs = measure_cost_ratios(target, {"base": drafter, "trained": trained, "itself": target}, PROMPTS[:2],
                                rounds=3, max_rounds=3, repeats=2)
    assert costs["pooled"] == [["base", "trained"]]
    assert costs["cost_ratios"]["base"] == costs["cost_ratios"]["trained"]
    assert costs["cost_ratio_range"]["base"] == costs["cost_ratio_range"]["trained"]  # the pooled rounds' range
    lo, hi = costs["cost_ratio_range"]["base"]
    assert lo <= costs["cost_ratios"]["base"] <= hi
    assert min(costs["cost_ratio_range"]["base"] + costs["cost_ratio_range"]["trained"]) <= \
        costs["cost_ratios"]["base"] <= max(costs["cost_ratio_range"]["base"] + costs["cost_ratio_range"]["trained"])
    assert costs["cost_ratios"]["itself"] == costs["cost_ratios_measured"]["itself"]
