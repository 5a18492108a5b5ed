"""Logits processing, sampling and the speculative acceptance step.

Small pure functions. Randomness always comes from an explicit
``torch.Generator`` argument (``None`` means torch's global generator), so a
seeded generator reproduces a run exactly.

Acceptance follows Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Algorithm 1, and Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling", Algorithm 2: accept
draft token ``x`` with probability ``min(1, target_probs[x] / draft_probs[x])``;
on the first rejection sample the replacement from
``norm(max(0, target_probs - draft_probs))``; when every draft token is
accepted sample a bonus token from the target's next distribution. The emitted
tokens are then distributed exactly as if sampled from the target alone.
"""

from __future__ import annotations

import torch


def check_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError unless temperature >= 0, top_k >= 0 and 0 < top_p <= 1."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def process_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Turn logits into the probabilities that decoding samples from.

    Args:
        logits: ``(..., vocab)``, any float dtype.
        temperature: > 0 divides the logits; 0 means greedy and returns the
            one-hot of the argmax (``top_k``/``top_p`` are then irrelevant).
        top_k: keep the ``top_k`` largest logits (ties at the boundary are
            kept); 0 keeps all.
        top_p: nucleus sampling (Holtzman et al. 2020): keep the smallest set
            of most likely tokens whose probability reaches ``top_p``; 1.0
            keeps all. The most likely token is always kept.

    Returns:
        float32 probabilities ``(..., vocab)`` summing to 1 over the last axis.

    Raises:
        ValueError: temperature < 0, top_k < 0, or top_p outside (0, 1].
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, sorted_index = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_index, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per distribution.

    Args:
        probs: ``(..., vocab)`` non-negative, rows need not be normalised.
        generator: source of randomness, on ``probs.device``; None uses
            torch's global generator.

    Returns:
        LongTensor ``(...)`` of token ids. A one-hot row always returns its hot
        index, so greedy probabilities from ``process_logits`` sample greedily.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, target_probs - draft_probs))``, the distribution after a rejection.

    Leviathan et al. 2023, Alg. 1 (``p'(x)``). Where the residual has no mass
    (draft and target agree up to rounding, so a rejection had probability
    ~0) the target distribution is returned instead.

    Args:
        target_probs, draft_probs: ``(..., vocab)`` float32 distributions.

    Returns:
        ``(..., vocab)`` float32, rows sum to 1.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


def speculative_accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K draft tokens by speculative sampling (Leviathan et al. 2023, Alg. 1).

    Draft token ``i`` is accepted with probability
    ``min(1, target_probs[i, x_i] / draft_probs[i, x_i])``; the first rejected
    position ``n`` is replaced by a sample of
    ``residual_probs(target_probs[n], draft_probs[n])``; if all K are accepted,
    a bonus token is sampled from ``target_probs[K]``. Vectorised over any
    leading batch axes; no host synchronisation.

    Args:
        target_probs: ``(..., K+1, vocab)`` float32, the target's distribution
            at each draft position plus the one after the last draft.
        draft_probs: ``(..., K, vocab)`` float32, the distributions the draft
            tokens were sampled from (same processing as the target's).
        draft_tokens: ``(..., K)`` LongTensor.
        generator: on the tensors' device; None uses torch's global generator.

    Returns:
        ``(num_accepted, next_token)``: LongTensors ``(...)``; ``num_accepted``
        in 0..K counts leading accepted drafts, ``next_token`` is the correction
        (``num_accepted < K``) or bonus (``num_accepted == K``) token.

    Raises:
        ValueError: shapes that do not line up.
    """
    num_draft = draft_tokens.shape[-1]
    if target_probs.shape[-2] != num_draft + 1 or draft_probs.shape[-2] != num_draft:
        raise ValueError(
            f"expected target_probs (..., K+1, V) and draft_probs (..., K, V) for K={num_draft} draft tokens, "
            f"got {tuple(target_probs.shape)} and {tuple(draft_probs.shape)}"
        )
    index = draft_tokens.unsqueeze(-1)
    target_at_draft = target_probs[..., :num_draft, :].gather(-1, index).squeeze(-1)
    draft_at_draft = draft_probs.gather(-1, index).squeeze(-1)
    uniform = torch.rand(draft_tokens.shape, generator=generator, device=draft_tokens.device)
    accepted = uniform * draft_at_draft < target_at_draft  # u < target/draft without dividing by 0
    num_accepted = accepted.long().cumprod(-1).sum(-1)
    # Row n of next_probs is what to sample after n accepted drafts.
    next_probs = torch.cat([residual_probs(target_probs[..., :num_draft, :], draft_probs),
                            target_probs[..., num_draft:, :]], dim=-2)
    row = num_accepted[..., None, None].expand(*num_accepted.shape, 1, next_probs.shape[-1])
    next_token = sample(next_probs.gather(-2, row).squeeze(-2), generator)
    return num_accepted, next_token


def greedy_accept(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K draft tokens at temperature 0: accept while they equal the target's argmax.

    The temperature-0 case of ``speculative_accept`` (one-hot distributions
    make the acceptance ratio 0 or 1 and the residual the target's one-hot),
    without drawing random numbers.

    Args:
        target_tokens: ``(..., K+1)`` LongTensor, the target's argmax at each
            draft position plus the one after the last draft.
        draft_tokens: ``(..., K)`` LongTensor.

    Returns:
        ``(num_accepted, next_token)`` LongTensors ``(...)``; ``next_token`` is
        the target's token after the accepted prefix (correction or bonus).
    """
    num_draft = draft_tokens.shape[-1]
    if target_tokens.shape[-1] != num_draft + 1:
        raise ValueError(f"expected target_tokens (..., {num_draft + 1}), got {tuple(target_tokens.shape)}")
    matches = (draft_tokens == target_tokens[..., :num_draft]).long()
    num_accepted = matches.cumprod(-1).sum(-1)
    next_token = target_tokens.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return num_accepted, next_token
