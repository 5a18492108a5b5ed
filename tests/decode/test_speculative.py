"""decode.speculative and decode.benchmark on tiny random Qwen2 models (fp32, seeded)."""


import pytest
import torch
from tiny_models import tiny_qwen2
from transformers import Qwen2ForCausalLM

from decode.benchmark import benchmark
from decode.costs import measure_cost_ratio
from decode.speculative import speculative_generate, target_generate

VOCAB = 300
PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 100, 250, 3, 3, 3, 9, 12, 61, 200, 5]]


def tiny_model(num_layers: int, seed: int, vocab_size: int = VOCAB, head_scale: float = 1.0) -> Qwen2ForCausalLM:
    return tiny_qwen2(num_layers, seed, vocab_size=vocab_size, head_scale=head_scale)


def padded(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    """``model`` with its vocabulary doubled by padding rows whose logits are 3x the real ones.

    The padding's max logit beats the real one whenever that is positive, so
    decoding is only right if the rows past the common vocabulary are ignored.
    """
    rows = model.config.vocab_size
    bigger = tiny_model(model.config.num_hidden_layers, seed=99, vocab_size=2 * rows)
    with torch.no_grad():
        for name, weight in bigger.state_dict().items():
            source = model.state_dict()[name]
            if name == "lm_head.weight":
                weight.copy_(torch.cat([source, 3 * source]))
            elif name == "model.embed_tokens.weight":
                weight[:rows] = source
            else:
                weight.copy_(source)
    return bigger


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(2, seed=0)


@pytest.fixture(scope="module")
def drafter():
    return tiny_model(1, seed=1)


@pytest.fixture(scope="module")
def references(target):
    """Greedy target output for each prompt, 40 tokens, no EOS."""
    return [target_generate(target, torch.tensor([p]), max_new_tokens=40, eos_token_ids=[]).new_tokens.tolist()
            for p in PROMPTS]


def generate(target, drafter, prompt, **kwargs):
    kwargs.setdefault("eos_token_ids", [])
    return speculative_generate(target, drafter, torch.tensor([prompt]), **kwargs)


# --- the baseline itself ----------------------------------------------------------------------------

def test_target_generate_matches_hf_greedy(target):
    for prompt in PROMPTS:
        ours = target_generate(target, torch.tensor([prompt]), max_new_tokens=20, eos_token_ids=[])
        hf = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert ours.new_tokens.tolist() == hf[0, len(prompt):].tolist()
        assert ours.stats.target_forwards == 20 and ours.stats.mean_accepted_tokens == 1.0


# --- greedy equality ----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_length", [1, 2, 4, 7])
def test_greedy_equals_target_with_random_drafter(target, drafter, references, draft_length):
    for prompt, reference in zip(PROMPTS, references):
        out = generate(target, drafter, prompt, draft_length=draft_length, max_new_tokens=40)
        assert out.new_tokens.tolist() == reference
        stats = out.stats
        assert stats.new_tokens == 40 == sum(a + 1 for a in stats.accepted_per_block)
        assert stats.target_forwards == len(stats.accepted_per_block)
        assert stats.draft_forwards == sum(stats.drafted_per_block)


@pytest.mark.parametrize("draft_length", [1, 2, 4, 7])
def test_greedy_equals_target_with_target_as_drafter(target, references, draft_length):
    for prompt, reference in zip(PROMPTS, references):
        out = generate(target, target, prompt, draft_length=draft_length, max_new_tokens=40)
        assert out.new_tokens.tolist() == reference
        stats = out.stats
        assert stats.acceptance_rate == 1.0
        assert stats.accepted_per_block[:-1] == [draft_length] * (len(stats.accepted_per_block) - 1)
        assert stats.accepted_per_block[-1] == stats.drafted_per_block[-1]  # the last block may be shorter
        assert stats.per_position_acceptance == [1.0] * draft_length
        if 40 % (draft_length + 1) == 0:
            assert stats.mean_accepted_tokens == draft_length + 1


def test_long_generation_keeps_full_acceptance(target):
    """200 tokens with the target drafting for itself: a cache off by one anywhere would show."""
    out = generate(target, target, PROMPTS[0], draft_length=4, max_new_tokens=200)
    assert out.stats.new_tokens == 200
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.accepted_per_block == [4] * 40
    assert out.stats.mean_accepted_tokens == 5.0
    reference = target_generate(target, torch.tensor([PROMPTS[0]]), max_new_tokens=200, eos_token_ids=[])
    assert torch.equal(out.new_tokens, reference.new_tokens)


def test_drafter_with_larger_padded_vocabulary(target, drafter, references):
    """V_draft > V_target: the drafter's padding rows (which would win argmax) are never drafted."""
    padded_drafter = padded(drafter)
    for prompt in PROMPTS:  # the premise: without masking the padding would be drafted
        assert padded_drafter(torch.tensor([prompt])).logits[0, -1].argmax() >= VOCAB
    for prompt, reference in zip(PROMPTS, references):
        out = generate(target, padded_drafter, prompt, draft_length=3, max_new_tokens=40)
        assert out.new_tokens.tolist() == reference
    # The same drafter weights on the real rows: identical acceptance.
    plain = generate(target, drafter, PROMPTS[2], draft_length=3, max_new_tokens=40).stats.accepted_per_block
    assert generate(target, padded_drafter, PROMPTS[2], draft_length=3, max_new_tokens=40).stats.accepted_per_block \
        == plain


def test_target_with_larger_padded_vocabulary(target):
    padded_target = padded(target)
    for prompt in PROMPTS:
        unmasked = target_generate(padded_target, torch.tensor([prompt]), max_new_tokens=1, eos_token_ids=[])
        assert unmasked.new_tokens[0] >= VOCAB  # the premise: the padding would win
        reference = target_generate(padded_target, torch.tensor([prompt]), max_new_tokens=30, eos_token_ids=[],
                                    vocab_size=VOCAB)
        out = generate(padded_target, target, prompt, draft_length=4, max_new_tokens=30)
        assert torch.equal(out.new_tokens, reference.new_tokens)
        assert out.stats.acceptance_rate == 1.0  # same weights on the common rows


# --- stopping ----------------------------------------------------------------------------------------

def test_eos_in_the_middle_of_a_block_stops_there(target, drafter, references):
    reference = references[0]
    # With the target as drafter and K=4 every block emits 5 tokens: position 7 is mid-block 2.
    position = next(i for i in range(6, 9) if reference[i] not in reference[:i])
    eos = reference[position]
    for draft_model in (target, drafter):
        out = generate(target, draft_model, PROMPTS[0], draft_length=4, max_new_tokens=40, eos_token_ids=[eos, 9999])
        assert out.new_tokens.tolist() == reference[: position + 1]
        assert out.stats.new_tokens == position + 1
    # and the baseline stops at the same place
    baseline = target_generate(target, torch.tensor([PROMPTS[0]]), max_new_tokens=40, eos_token_ids=[eos])
    assert baseline.new_tokens.tolist() == reference[: position + 1]


def test_eos_as_first_token(target, drafter, references):
    out = generate(target, drafter, PROMPTS[1], draft_length=4, max_new_tokens=40, eos_token_ids=[references[1][0]])
    assert out.new_tokens.tolist() == references[1][:1]


@pytest.mark.parametrize("draft_length", [1, 3, 4])
def test_max_new_tokens_is_never_exceeded(target, drafter, references, draft_length):
    for max_new_tokens in range(0, 13):
        for draft_model in (target, drafter):
            out = generate(target, draft_model, PROMPTS[0], draft_length=draft_length, max_new_tokens=max_new_tokens)
            assert out.new_tokens.tolist() == references[0][:max_new_tokens]
            assert sum(a + 1 for a in out.stats.accepted_per_block) == max_new_tokens
            assert all(d <= draft_length for d in out.stats.drafted_per_block)


def test_bad_arguments_raise(target, drafter):
    with pytest.raises(ValueError, match="draft_length"):
        generate(target, drafter, PROMPTS[0], draft_length=0, max_new_tokens=5)
    with pytest.raises(ValueError, match="input_ids"):
        speculative_generate(target, drafter, torch.tensor([[1, 2], [3, 4]]), draft_length=2, max_new_tokens=5,
                             eos_token_ids=[])
    with pytest.raises(ValueError, match="input_ids"):
        target_generate(target, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=5, eos_token_ids=[])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, drafter, PROMPTS[0], draft_length=2, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, drafter, PROMPTS[0], draft_length=2, max_new_tokens=5, temperature=-1.0)


# --- cache rollback arithmetic -------------------------------------------------------------------------

def record_forwards(model):
    """Record (cache length before the call, input ids) for every forward of ``model``."""
    calls = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        calls.append((cache.get_seq_length(), kwargs["input_ids"][0].tolist()))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("same_weights", [False, True], ids=["random-drafter", "target-as-drafter"])
@pytest.mark.parametrize("draft_length", [1, 3, 5])
def test_cache_rollback_arithmetic(target, drafter, same_weights, draft_length):
    """After each block: target cache = prompt_len + emitted - 1 (the last token is fed next);
    drafter cache = the same, minus 1 after a fully accepted block (its last draft is fed,
    with the pending token, at its next forward). Every fed token is the true sequence's."""
    draft_model = tiny_model(2, seed=0) if same_weights else drafter  # a separate module to hook
    prompt = PROMPTS[2]
    target_calls, target_hook = record_forwards(target)
    draft_calls, draft_hook = record_forwards(draft_model)
    try:
        out = generate(target, draft_model, prompt, draft_length=draft_length, max_new_tokens=37)
    finally:
        target_hook.remove()
        draft_hook.remove()
    stats, seq = out.stats, prompt + out.new_tokens.tolist()
    assert (stats.acceptance_rate == 1.0) == same_weights
    # prefill: everything but the last prompt token, into empty caches
    assert target_calls[0] == (0, prompt[:-1]) and draft_calls[0] == (0, prompt[:-1])
    target_calls, draft_calls = target_calls[1:], draft_calls[1:]
    assert len(target_calls) == len(stats.accepted_per_block) and len(draft_calls) == stats.draft_forwards

    emitted, draft_index, drafter_behind = 0, 0, 0
    for block, (accepted, drafted) in enumerate(zip(stats.accepted_per_block, stats.drafted_per_block)):
        target_len, target_input = target_calls[block]
        assert target_len == len(prompt) + emitted - 1
        assert len(target_input) == drafted + 1
        assert target_input[: accepted + 1] == seq[target_len: target_len + accepted + 1]
        if accepted < drafted:  # the rejected draft differs from what the target emitted there
            assert target_input[accepted + 1] != seq[target_len + accepted + 1]
        for i in range(drafted):
            draft_len, draft_input = draft_calls[draft_index + i]
            if i == 0:
                assert draft_len == len(prompt) + emitted - 1 - drafter_behind
                assert draft_input == seq[draft_len: len(prompt) + emitted]  # catch-up + pending token
                first_len, first_input = draft_len, draft_input
            else:
                assert draft_len == first_len + len(first_input) + i - 1
                assert draft_input == [target_input[i]]
        draft_index += drafted
        emitted += accepted + 1
        drafter_behind = 1 if drafted and accepted == drafted else 0
    assert emitted == stats.new_tokens == 37
    if same_weights:
        assert any(len(inp) == 2 for _, inp in draft_calls)  # the catch-up path ran


# --- sampling ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_seeded_sampling_reproduces(target, drafter, sampling):
    def run(seed):
        return generate(target, drafter, PROMPTS[0], draft_length=3, max_new_tokens=30,
                        generator=torch.Generator().manual_seed(seed), **sampling)

    first, second, other = run(5), run(5), run(6)
    assert torch.equal(first.new_tokens, second.new_tokens)
    assert first.stats.accepted_per_block == second.stats.accepted_per_block
    assert not torch.equal(first.new_tokens, other.new_tokens)
    assert len(first.new_tokens) == 30


def test_sampling_with_target_as_drafter_accepts_everything(target):
    out = generate(target, target, PROMPTS[0], draft_length=4, max_new_tokens=50, temperature=0.8, top_k=50,
                   top_p=0.95, generator=torch.Generator().manual_seed(0))
    assert out.stats.acceptance_rate == 1.0


def first_token_frequencies(target, drafter, prompt, vocab: int, num_runs: int, temperature: float) -> torch.Tensor:
    """Empirical distribution ``(vocab,)`` of the first token speculative sampling emits after ``prompt``
    ``(1, seq)``, over ``num_runs`` seeded runs with K = 1 (shared by the statistical exactness tests)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab)
    for _ in range(num_runs):
        out = speculative_generate(target, drafter, prompt, draft_length=1, max_new_tokens=2,
                                   eos_token_ids=[], temperature=temperature, generator=generator)
        counts[out.new_tokens[0]] += 1
    return counts / num_runs


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_follows_target_distribution(temperature):
    """Full loop at temperature > 0: the first emitted token is distributed as the target's.

    Vocabulary of 6 so that 1,500 runs resolve the distribution; the drafter
    differs from the target (acceptance ~0.6-0.75). The bound is ~3x the
    sampling noise; the known-wrong rule "accept with probability
    target_probs[x]" and emitting the drafter's distribution are both > 4x it.
    """
    num_runs, vocab = 1500, 6
    small_target, small_drafter = tiny_model(2, 0, vocab, head_scale=4.0), tiny_model(1, 1, vocab, head_scale=4.0)
    prompt = torch.tensor([[3]])
    with torch.no_grad():
        target_probs = torch.softmax(small_target(prompt).logits[0, -1] / temperature, -1)
        draft_probs = torch.softmax(small_drafter(prompt).logits[0, -1] / temperature, -1)
    empirical = first_token_frequencies(small_target, small_drafter, prompt, vocab, num_runs, temperature)

    def tv(a, b):
        return 0.5 * (a - b).abs().sum().item()

    accepted_by_wrong_rule = draft_probs * target_probs
    residual = (target_probs - draft_probs).clamp_min(0)
    wrong = accepted_by_wrong_rule + (1 - accepted_by_wrong_rule.sum()) * residual / residual.sum()
    bound = 0.06
    assert tv(wrong, target_probs) > 4 * bound and tv(draft_probs, target_probs) > 4 * bound
    assert tv(empirical, target_probs) < bound
    chi_square = (num_runs * (empirical - target_probs) ** 2 / target_probs).sum().item()
    assert chi_square < 20.52  # chi-square, 5 degrees of freedom, p = 0.001


# --- benchmark ------------------------------------------------------------------------------------------

def test_benchmark_on_tiny_models(target, drafter):
    prompts = [("a", "code", PROMPTS[0]), ("b", "chat", PROMPTS[1]), ("c", "code", PROMPTS[2])]
    result = benchmark(target, target, prompts, draft_length=3, max_new_tokens=16, eos_token_ids=[], progress=False)
    assert result["outputs_match_target"] is True
    assert result["acceptance_rate"] == 1.0 and result["mean_accepted_tokens"] == 4.0
    assert result["num_prompts"] == 3 and result["new_tokens"] == 48 and result["draft_length"] == 3
    assert result["baselines"]["hf_assisted"]["outputs_match_target"] is True
    assert result["baselines"]["hf_assisted"]["new_tokens"] == 48
    assert set(result["per_category"]) == {"code", "chat"}
    assert result["per_category"]["code"]["num_prompts"] == 2
    for key in ("target_tokens_per_s", "speculative_tokens_per_s", "speedup", "cost_ratio", "theoretical_speedup"):
        assert result[key] > 0
    assert result["speedup"] == pytest.approx(result["speculative_tokens_per_s"] / result["target_tokens_per_s"])
    assert len(result["per_prompt"]) == 3

    result = benchmark(target, drafter, prompts[:1], draft_length=2, max_new_tokens=8, eos_token_ids=[],
                       progress=False)
    assert result["outputs_match_target"] is True
    assert result["baselines"]["hf_assisted"]["outputs_match_target"] is True


def test_benchmark_skips_hf_with_padded_drafter(target, drafter):
    with pytest.warns(UserWarning, match="vocabulary sizes differ"):
        result = benchmark(target, padded(drafter), [("a", "code", PROMPTS[0])],
                           draft_length=2, max_new_tokens=8, eos_token_ids=[], progress=False)
    assert result["outputs_match_target"] is True
    assert result["baselines"]["hf_assisted"] is None and result["notes"]


def test_measure_cost_ratio(target, drafter):
    assert 0 < measure_cost_ratio(target, drafter, [PROMPTS[0]], repeats=3) < 10


# --- the real model ------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.slow
def test_real_qwen_greedy_equals_target(qwen05):
    """Real 0.5B as target, its first 4 layers as drafter (mostly rejected): output identical to greedy."""
    from distill.drafters.build import build_drafter

    model, tokenizer = qwen05
    drafter = build_drafter(model, init="layers", num_layers=4).eval()
    input_ids = tokenizer("def quicksort(items):\n", return_tensors="pt").input_ids
    eos = [tokenizer.eos_token_id]
    reference = target_generate(model, input_ids, max_new_tokens=32, eos_token_ids=eos)
    out = speculative_generate(model, drafter, input_ids, draft_length=3, max_new_tokens=32, eos_token_ids=eos)
    assert torch.equal(out.new_tokens, reference.new_tokens)
    assert out.stats.new_tokens == reference.stats.new_tokens > 0
    # the drafter equal to the target: every draft accepted, still identical
    same = speculative_generate(model, model, input_ids, draft_length=3, max_new_tokens=32, eos_token_ids=eos)
    assert torch.equal(same.new_tokens, reference.new_tokens)
    assert same.stats.acceptance_rate == 1.0
