"""decode.batched: batch > 1 with ragged prompts and ragged acceptance, lossless per row."""

import pytest
import torch

from decode.batched import speculative_generate_batch
from decode.speculative import speculative_generate, target_generate
from tests.decode.test_speculative import PROMPTS, drafter, target, tiny_model  # noqa: F401 (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")
RAGGED = PROMPTS + [[9, 8, 7, 6], [250] * 7]


def alone(target, prompt, n, eos=()):
    return target_generate(target, torch.tensor([prompt]), max_new_tokens=n, eos_token_ids=list(eos)).new_tokens


@pytest.mark.parametrize("draft_length", [1, 3, 5])
def test_batched_greedy_equals_each_row_decoded_alone(target, drafter, draft_length):
    outs = speculative_generate_batch(target, drafter, RAGGED, draft_length=draft_length, max_new_tokens=30,
                                      eos_token_ids=[])
    for prompt, out in zip(RAGGED, outs):
        assert torch.equal(out.new_tokens, alone(target, prompt, 30))
        assert out.stats.new_tokens == 30


def test_batched_with_target_as_drafter_accepts_everything(target):
    outs = speculative_generate_batch(target, target, RAGGED, draft_length=3, max_new_tokens=21, eos_token_ids=[])
    for prompt, out in zip(RAGGED, outs):
        assert torch.equal(out.new_tokens, alone(target, prompt, 21))
        assert out.stats.acceptance_rate == 1.0


def test_rows_stop_at_their_own_eos_and_length(target, drafter):
    references = [alone(target, p, 30).tolist() for p in RAGGED]
    stop_at = next(i for i in range(5, 30) if references[0][i] not in references[0][:i])
    eos = references[0][stop_at]  # first emitted mid-way through row 0; other rows may or may not emit it
    outs = speculative_generate_batch(target, drafter, RAGGED, draft_length=3, max_new_tokens=30, eos_token_ids=[eos])
    for prompt, out in zip(RAGGED, outs):
        expected = alone(target, prompt, 30, eos=[eos]).tolist()
        assert out.new_tokens.tolist() == expected
        assert eos not in expected[:-1]
    assert len(outs[0].new_tokens) == stop_at + 1
    short = speculative_generate_batch(target, drafter, RAGGED, draft_length=4, max_new_tokens=6, eos_token_ids=[])
    assert all(len(o.new_tokens) == 6 for o in short)
    assert all(len(o.new_tokens) == 0 for o in speculative_generate_batch(
        target, drafter, RAGGED, draft_length=2, max_new_tokens=0, eos_token_ids=[]))


def test_batch_of_one_equals_the_single_row_decoder(target, drafter):
    single = speculative_generate(target, drafter, torch.tensor([PROMPTS[2]]), draft_length=3, max_new_tokens=25,
                                  eos_token_ids=[])
    [batched] = speculative_generate_batch(target, drafter, [PROMPTS[2]], draft_length=3, max_new_tokens=25,
                                           eos_token_ids=[])
    assert torch.equal(batched.new_tokens, single.new_tokens)
    assert batched.stats.accepted_per_block == single.stats.accepted_per_block


def test_bad_batches_raise(target, drafter):
    with pytest.raises(ValueError, match="empty"):
        speculative_generate_batch(target, drafter, [[1], []], draft_length=2, max_new_tokens=4, eos_token_ids=[])
    with pytest.raises(ValueError, match="draft_length"):
        speculative_generate_batch(target, drafter, [[1]], draft_length=0, max_new_tokens=4, eos_token_ids=[])


@pytest.mark.slow
def test_batched_sampling_follows_target_distribution_over_two_tokens():
    """Joint law of the first two tokens of a row sampled in a batch beside another row.

    K = 2 and a second row with a different prompt make the synchronised
    advance truncate this row's blocks at random points; the emitted pair must
    still follow p(x1) p(x2 | x1) of the target. Vocabulary 6 (36 cells), 2,400
    batches; bound ~3x the sampling noise, and the drafter's own law is far outside it.
    """
    vocab, runs, temperature = 6, 2400, 1.0
    small_target = tiny_model(2, 0, vocab, head_scale=4.0)
    small_drafter = tiny_model(1, 1, vocab, head_scale=4.0)

    def joint(model):
        with torch.no_grad():
            first = torch.softmax(model(torch.tensor([[3]])).logits[0, -1] / temperature, -1)
            second = torch.softmax(model(torch.tensor([[3, x] for x in range(vocab)])).logits[:, -1] / temperature, -1)
        return (first[:, None] * second).flatten()

    expected, drafter_law = joint(small_target), joint(small_drafter)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    for _ in range(runs):
        outs = speculative_generate_batch(small_target, small_drafter, [[3], [5, 1, 2]], draft_length=2,
                                          max_new_tokens=2, eos_token_ids=[], temperature=temperature,
                                          generator=generator)
        a, b = outs[0].new_tokens.tolist()
        counts[a * vocab + b] += 1
    empirical = counts / runs
    tv = 0.5 * (empirical - expected).abs().sum().item()
    bound = 0.09
    assert 0.5 * (drafter_law - expected).abs().sum().item() > 2 * bound
    assert tv < bound
