"""Property tests of the decoders on tiny random models (hypothesis): random K, schedules, temperatures,
EOS ids, length limits and batch shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode.batched import speculative_generate_batch
from decode.speculative import speculative_generate, target_generate
from tests.decode.test_speculative import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 40  # small, so random EOS ids actually occur
TARGET, DRAFTER = tiny_model(2, seed=0, vocab_size=VOCAB, head_scale=3.0), tiny_model(1, seed=1, vocab_size=VOCAB)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
eos_sets = st.lists(st.integers(0, VOCAB - 1), max_size=2)


def _consistent(stats, out_len: int, max_new_tokens: int) -> None:
    assert out_len <= max_new_tokens
    assert stats.new_tokens == out_len
    assert all(0 <= a <= d for a, d in zip(stats.accepted_per_block, stats.drafted_per_block))
    # each block emits accepted + 1 tokens, the last one possibly cut by EOS / the limit
    assert out_len <= sum(a + 1 for a in stats.accepted_per_block)
    assert stats.target_forwards == len(stats.accepted_per_block)
    assert 0.0 <= stats.acceptance_rate <= 1.0


@SETTINGS
@given(prompt=prompts, k=st.integers(1, 7), max_new=st.integers(0, 25), eos=eos_sets,
       schedule=st.sampled_from(["constant", "heuristic"]), threshold=st.sampled_from([0.0, 0.2, 0.6]))
def test_greedy_equals_target_under_any_settings(prompt, k, max_new, eos, schedule, threshold):
    ids = torch.tensor([prompt])
    reference = target_generate(TARGET, ids, max_new_tokens=max_new, eos_token_ids=eos).new_tokens.tolist()
    out = speculative_generate(TARGET, DRAFTER, ids, draft_length=k, max_new_tokens=max_new, eos_token_ids=eos,
                               schedule=schedule, confidence_threshold=threshold)
    tokens = out.new_tokens.tolist()
    assert tokens == reference
    assert not any(t in eos for t in tokens[:-1])  # nothing after an EOS
    _consistent(out.stats, len(tokens), max_new)


@SETTINGS
@given(prompt=prompts, k=st.integers(1, 6), max_new=st.integers(0, 20), eos=eos_sets,
       temperature=st.sampled_from([0.5, 1.0, 1.5]), top_k=st.sampled_from([0, 5]),
       top_p=st.sampled_from([1.0, 0.8]), seed=st.integers(0, 2**16))
def test_sampling_respects_limits_and_reproduces(prompt, k, max_new, eos, temperature, top_k, top_p, seed):
    ids = torch.tensor([prompt])

    def run():
        return speculative_generate(TARGET, DRAFTER, ids, draft_length=k, max_new_tokens=max_new, eos_token_ids=eos,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    generator=torch.Generator().manual_seed(seed))

    first, second = run(), run()
    tokens = first.new_tokens.tolist()
    assert tokens == second.new_tokens.tolist()
    assert not any(t in eos for t in tokens[:-1])
    assert all(0 <= t < VOCAB for t in tokens)
    _consistent(first.stats, len(tokens), max_new)


@SETTINGS
@given(batch=st.lists(prompts, min_size=1, max_size=4), k=st.integers(1, 5), max_new=st.integers(0, 20),
       eos=eos_sets)
def test_batched_greedy_equals_each_row_alone(batch, k, max_new, eos):
    outs = speculative_generate_batch(TARGET, DRAFTER, batch, draft_length=k, max_new_tokens=max_new,
                                      eos_token_ids=eos)
    assert len(outs) == len(batch)
    for prompt, out in zip(batch, outs):
        reference = target_generate(TARGET, torch.tensor([prompt]), max_new_tokens=max_new, eos_token_ids=eos)
        assert out.new_tokens.tolist() == reference.new_tokens.tolist()
        _consistent(out.stats, len(out.new_tokens), max_new)
