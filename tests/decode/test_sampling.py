"""decode.sampling: logits processing and the speculative acceptance step, checked exactly and statistically."""

import pytest
import torch

from decode.sampling import (
    greedy_accept,
    process_logits,
    residual_probs,
    sample,
    speculative_accept,
)

TARGET_PROBS = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
DRAFT_PROBS = {
    "close": torch.tensor([0.30, 0.30, 0.20, 0.15, 0.05]),
    "far": torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40]),
}
NUM_SAMPLES = 200_000


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def wrong_rule_distribution(target_probs, draft_probs):
    """Output distribution of the known-wrong rule "accept x with probability target_probs[x]"."""
    accepted = draft_probs * target_probs
    return accepted + (1 - accepted.sum()) * residual_probs(target_probs, draft_probs)


# --- process_logits -----------------------------------------------------------------------------

def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    probs = process_logits(logits, temperature=0.0, top_k=2, top_p=0.5)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_softmax_in_float32():
    logits = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    probs = process_logits(logits, temperature=0.5)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(torch.tensor([2.0, 4.0, 6.0]), -1))


def test_top_k_keeps_k_largest():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    probs = process_logits(logits, top_k=2)
    assert torch.allclose(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    # 0.4 + 0.3 = 0.7 >= 0.6: the nucleus is {1, 3}
    assert torch.allclose(process_logits(logits, top_p=0.6), torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # 0.4 alone reaches 0.4: only the top token
    assert torch.allclose(process_logits(logits, top_p=0.4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # a tiny top_p still keeps the most likely token
    assert torch.allclose(process_logits(logits, top_p=1e-6), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_process_logits_batched_rows_sum_to_one():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    probs = process_logits(logits, temperature=0.8, top_k=10, top_p=0.9)
    assert probs.shape == (3, 4, 50)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4))
    assert ((probs > 0).sum(-1) <= 10).all()


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_process_logits_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        process_logits(torch.zeros(4), **kwargs)


# --- sample ---------------------------------------------------------------------------------------

def test_sample_is_reproducible_with_a_seed():
    probs = torch.full((1000, 7), 1 / 7)
    first = sample(probs, torch.Generator().manual_seed(3))
    second = sample(probs, torch.Generator().manual_seed(3))
    assert first.shape == (1000,) and first.dtype == torch.long
    assert torch.equal(first, second)


def test_sample_one_hot_is_deterministic():
    probs = torch.nn.functional.one_hot(torch.tensor([4, 0, 2]), 5).float()
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [4, 0, 2]


# --- acceptance -----------------------------------------------------------------------------------

def test_residual_probs():
    target_probs, draft_probs = TARGET_PROBS, DRAFT_PROBS["close"]
    expected = torch.tensor([0.10, 0.0, 0.0, 0.0, 0.0]) / 0.10
    assert torch.allclose(residual_probs(target_probs, draft_probs), expected)
    # identical distributions: no residual mass, fall back to the target
    assert torch.allclose(residual_probs(target_probs, target_probs), target_probs)


def test_greedy_accept_counts_leading_matches():
    target_tokens = torch.tensor([5, 6, 7, 8])
    assert [t.item() for t in greedy_accept(target_tokens, torch.tensor([5, 6, 7]))] == [3, 8]
    assert [t.item() for t in greedy_accept(target_tokens, torch.tensor([5, 9, 7]))] == [1, 6]
    assert [t.item() for t in greedy_accept(target_tokens, torch.tensor([1, 6, 7]))] == [0, 5]
    assert [t.item() for t in greedy_accept(target_tokens[:1], torch.tensor([], dtype=torch.long))] == [0, 5]


def test_speculative_accept_on_one_hot_probs_is_greedy():
    """Temperature 0 is a special case of the stochastic rule: same answer as greedy_accept."""
    generator = torch.Generator().manual_seed(0)
    vocab = 11
    for _ in range(200):
        target_tokens = torch.randint(0, 3, (5,), generator=generator)
        draft_tokens = torch.randint(0, 3, (4,), generator=generator)
        target_probs = torch.nn.functional.one_hot(target_tokens, vocab).float()
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).float()
        got = speculative_accept(target_probs, draft_probs, draft_tokens, generator)
        want = greedy_accept(target_tokens, draft_tokens)
        assert [t.item() for t in got] == [t.item() for t in want]


def test_identical_distributions_accept_everything():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1000, 4, 30, generator=generator), -1)
    draft_tokens = sample(probs[:, :3], generator)
    num_accepted, _ = speculative_accept(probs, probs[:, :3], draft_tokens, generator)
    assert (num_accepted == 3).all()


def test_speculative_accept_rejects_bad_shapes():
    with pytest.raises(ValueError):
        speculative_accept(torch.rand(3, 5), torch.rand(3, 5), torch.zeros(3, dtype=torch.long), None)


@pytest.mark.parametrize("draft_name", ["close", "far"])
def test_one_step_output_follows_target_distribution(draft_name):
    """Leviathan et al. 2023, Thm 3.5: the emitted token is distributed as target_probs.

    200k draws of (draft token, accept or residual) vectorised over a batch axis; the
    known-wrong rule "accept with probability target_probs[x]" is far outside the bound.
    """
    generator = torch.Generator().manual_seed(1234)
    target_probs, draft_probs = TARGET_PROBS, DRAFT_PROBS[draft_name]
    draft_tokens = sample(draft_probs.expand(NUM_SAMPLES, 5), generator).unsqueeze(-1)  # (N, 1)
    num_accepted, next_token = speculative_accept(
        torch.stack([target_probs, target_probs]).expand(NUM_SAMPLES, 2, 5),
        draft_probs.expand(NUM_SAMPLES, 1, 5),
        draft_tokens,
        generator,
    )
    first_token = torch.where(num_accepted == 1, draft_tokens[:, 0], next_token)
    empirical = torch.bincount(first_token, minlength=5).float() / NUM_SAMPLES
    assert total_variation(empirical, target_probs) < 0.01
    assert total_variation(wrong_rule_distribution(target_probs, draft_probs), target_probs) > 0.05
    # acceptance probability is sum(min(target, draft)) (Leviathan et al. 2023, Cor. 3.6)
    expected_acceptance = torch.minimum(target_probs, draft_probs).sum().item()
    assert abs(num_accepted.float().mean().item() - expected_acceptance) < 0.01


def test_bonus_token_follows_the_last_target_distribution():
    """After K accepted drafts the bonus comes from target_probs[K]."""
    generator = torch.Generator().manual_seed(7)
    target_probs = torch.stack([TARGET_PROBS, TARGET_PROBS.flip(0)])  # position 1 differs
    draft_tokens = sample(TARGET_PROBS.expand(NUM_SAMPLES, 5), generator).unsqueeze(-1)
    num_accepted, next_token = speculative_accept(
        target_probs.expand(NUM_SAMPLES, 2, 5), TARGET_PROBS.expand(NUM_SAMPLES, 1, 5), draft_tokens, generator)
    assert (num_accepted == 1).all()  # draft == target: always accepted
    empirical = torch.bincount(next_token, minlength=5).float() / NUM_SAMPLES
    assert total_variation(empirical, TARGET_PROBS.flip(0)) < 0.01
