"""Distillation losses between a draft model (student) and the target (teacher).

Notation used throughout (DistillSpec, Zhou et al. 2023, arXiv:2310.08461):

* ``target_probs`` = p, the target's next-token distribution (the teacher),
* ``draft_probs``  = q, the drafter's next-token distribution (the student).

All functions are pure: they take logits, compute ``log_softmax(logits / temperature)`` in
float32 and return float32. Logits may come in another dtype (bf16 target): they are cast.
Student and target vocabularies may differ by padding rows (e.g. a 151,936-row lm_head over a
151,665-token tokenizer): both are sliced to the common ``min(V_student, V_target)`` columns.

Reductions are token-weighted: the per-position divergence is averaged over the positions
where ``mask`` is True, so a batch with 300 completion tokens weighs 3x one with 100.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distill.models.reduced_vocab import draft_indices

LOSS_KINDS = ("fkl", "rkl", "jsd", "tvd", "ce")
_IMPOSSIBLE_LOGP = -1e4  # exp() underflows to exactly 0 in float32, yet differences and gradients stay finite


def distillation_loss(
    student_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    jsd_beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-weighted mean divergence between target and drafter over the masked positions.

    Args:
        student_logits: drafter logits, ``(batch, seq, vocab_s)``, any float dtype.
        target_logits: target logits, ``(batch, seq, vocab_t)``; no gradient flows into them.
        mask: ``(batch, seq)`` bool, True where the position counts (completion tokens).
        kind: one of

            * ``"fkl"``: forward KL ``KL(p || q) = sum_v p (log p - log q)``. This is the true KL,
              including the target-entropy term ``sum p log p`` (it does not change gradients but
              makes identical distributions score exactly 0; without it the value is
              cross-entropy ``H(p, q)``, which is what torchtune's "ForwardKLLoss" returns).
            * ``"rkl"``: reverse KL ``KL(q || p)`` (mode-seeking).
            * ``"jsd"``: generalized Jensen-Shannon divergence, see ``jsd_beta``.
            * ``"tvd"``: total variation ``0.5 * sum_v |p - q|``; ``1 - TVD`` is the acceptance
              probability of speculative sampling (Leviathan et al. 2023, Cor. 3.6), so this
              loss optimises acceptance directly (DistillSpec, Zhou et al. 2023).
            * ``"ce"``: cross-entropy ``-log q(label)`` on the target's sampled tokens
              (sequence-level KD, "SeqKD"); needs ``labels``; ``target_logits`` are unused
              except for the vocabulary check.
        jsd_beta: beta in [0, 1] for ``kind="jsd"``. Convention (GKD, Agarwal et al. 2024,
            Eq. 2-3, with P = target, Q = drafter, M = beta P + (1 - beta) Q)::

                JSD_beta = beta KL(P || M) + (1 - beta) KL(Q || M)
                loss     = JSD_beta / (beta (1 - beta))        for 0 < beta < 1
                loss     = KL(P || Q)  (forward KL)            for beta = 0
                loss     = KL(Q || P)  (reverse KL)            for beta = 1

            GKD's unscaled JSD_beta tends to 0 at both ends (its *gradient direction* tends to
            forward/reverse KL); dividing by beta (1 - beta) makes the values themselves
            continuous in beta with exact limits FKL at 0 and RKL at 1. The minimiser and the
            gradient direction are GKD's; the scale is 1 / (beta (1 - beta)) larger (4x at 0.5),
            which acts like a larger learning rate. TRL's ``generalized_jsd_loss`` returns the
            unscaled value for 0 < beta < 1 and jumps to FKL/RKL at the ends.
        temperature: > 0; both distributions are ``softmax(logits / temperature)``. No ``T**2``
            rescaling is applied.
        labels: ``(batch, seq)`` int64 token ids for ``kind="ce"`` (the token at t + 1 for the
            logits at t); values at masked-out positions are ignored.

    Returns:
        A 0-dim float32 tensor, in nats per masked token. 0 (with a gradient path) if the mask
        selects nothing.

    Raises:
        ValueError: unknown ``kind``, ``jsd_beta`` outside [0, 1], ``temperature <= 0``,
            mismatched shapes, or ``kind="ce"`` without ``labels`` / with an out-of-vocab label.
    """
    per_token = _masked_per_token(student_logits, target_logits, mask, kind=kind, jsd_beta=jsd_beta,
                                  temperature=temperature, labels=labels)
    if per_token.numel() == 0:
        return student_logits[..., :0].float().sum()  # 0, keeps the graph for backward()
    return per_token.mean()


def per_token_divergence(
    student_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    kind: str,
    jsd_beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The divergence of :func:`distillation_loss` at every position, unreduced.

    Args:
        student_logits: ``(..., vocab_s)``. target_logits: ``(..., vocab_t)``, same leading shape.
        labels: ``(...)`` int64, only for ``kind="ce"``.
        Other arguments as in :func:`distillation_loss`.

    Returns:
        float32 tensor with the leading shape ``(...)``, nats.
    """
    _check_args(kind, jsd_beta, temperature)
    if student_logits.shape[:-1] != target_logits.shape[:-1]:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and target logits "
                         f"{tuple(target_logits.shape)} differ before the vocabulary dimension")
    student_logp, target_logp = _log_probs(student_logits, target_logits, temperature)
    if kind == "ce":
        return _cross_entropy(student_logp, labels)
    return divergence_from_log_probs(student_logp, target_logp, kind=kind, jsd_beta=jsd_beta)


def divergence_from_log_probs(student_logp: torch.Tensor, target_logp: torch.Tensor, *, kind: str,
                              jsd_beta: float = 0.5) -> torch.Tensor:
    """The divergences of :func:`distillation_loss` between two normalised log-distributions.

    Args:
        student_logp, target_logp: ``(..., n)`` float32 log-probabilities over the same ``n``
            outcomes (a vocabulary, or the ``k + 1`` buckets of :func:`top_k_log_probs`);
            ``-inf`` marks an outcome of probability 0.
        kind: ``"fkl"``, ``"rkl"``, ``"jsd"`` or ``"tvd"`` (``"ce"`` needs token labels: use
            :func:`per_token_divergence`).

    Returns:
        float32 ``(...)``, nats (TVD: a probability in [0, 1]).
    """
    _check_args(kind, jsd_beta, 1.0)
    if kind == "ce":
        raise ValueError("kind='ce' is a loss on token labels, not a divergence between distributions")
    if kind == "fkl":
        return _kl(target_logp, student_logp)
    if kind == "rkl":
        return _kl(student_logp, target_logp)
    if kind == "tvd":
        return 0.5 * (target_logp.exp() - student_logp.exp()).abs().sum(-1)
    # kind == "jsd"
    if jsd_beta == 0.0:
        return _kl(target_logp, student_logp)
    if jsd_beta == 1.0:
        return _kl(student_logp, target_logp)
    mixture_logp = torch.logsumexp(
        torch.stack([target_logp + math.log(jsd_beta), student_logp + math.log1p(-jsd_beta)]), dim=0)
    jsd = jsd_beta * _kl(target_logp, mixture_logp) + (1.0 - jsd_beta) * _kl(student_logp, mixture_logp)
    return jsd / (jsd_beta * (1.0 - jsd_beta))


def top_k_log_probs(
    student_logits: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_logprobs: torch.Tensor,
    *,
    temperature: float = 1.0,
    drop_impossible: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions coarsened to the target's stored top-k tokens plus one "rest" bucket.

    ``generate.store_top_k`` keeps only the target's k most likely tokens per position, so the
    full target distribution p is unknown. Rather than renormalising p over the k tokens (which
    pretends the rest has probability 0 and lets the drafter put its remaining mass anywhere),
    both distributions are mapped onto the same ``k + 1`` outcomes: the k stored tokens and
    "any other token", with masses ``1 - sum_topk p`` and ``1 - sum_topk q``. Every divergence
    of :func:`divergence_from_log_probs` on these coarsened distributions is exact when the
    rest of p is 0 and otherwise a lower bound of the full-vocabulary one (data-processing
    inequality: merging outcomes never increases an f-divergence; Cover & Thomas, Thm. 2.8.1),
    so ``1 - TVD`` here is an upper bound of the true acceptance probability. With k = 20 the
    rest of a code model's distribution is usually below 1e-3.

    The stored log-probabilities are the target's at temperature 1; the student is scaled by
    ``temperature``, so use 1 (the default) unless you mean to compare unlike temperatures.

    Args:
        student_logits: ``(..., vocab)`` drafter logits, any float dtype.
        top_k_ids: ``(..., k)`` int64 token ids stored by generate, each < vocab.
        top_k_logprobs: ``(..., k)`` the target's log-probabilities of those tokens (<= 0,
            summing to <= 1 in probability).
        temperature: > 0, applied to the student only.
        drop_impossible: renormalise the target without the tokens the drafter gives probability
            0 (the training objective); False keeps the target as stored (for acceptance, where
            that mass is simply never accepted).

    Returns:
        ``(student_logp, target_logp)``, each ``(..., k + 1)`` float32; the last column is the
        rest bucket. The target's rest mass is floored at 1e-7 (float32 rounding can push
        ``1 - sum`` to 0 or below), so reverse KL stays finite; when the k ids cover the whole
        vocabulary both rests are 0. Stored tokens the drafter gives probability exactly 0 (outside
        a reduced vocabulary, :mod:`distill.models.reduced_vocab`) get target probability 0 too, and the
        target is renormalised over the remaining buckets.

    Raises:
        ValueError: mismatched shapes, an id outside the student's vocabulary, temperature <= 0.
    """
    _check_top_k(student_logits, top_k_ids, top_k_logprobs, temperature)
    student_top, student_rest = _student_top_and_rest(student_logits, top_k_ids.long(), temperature)
    return _coarsened(student_top, student_rest, top_k_logprobs, drop_impossible)


def _check_top_k(student_logits: torch.Tensor, top_k_ids: torch.Tensor, top_k_logprobs: torch.Tensor,
                 temperature: float) -> None:
    """Raises ValueError for :func:`top_k_log_probs`' bad arguments."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k_ids.shape != top_k_logprobs.shape or top_k_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"student logits {tuple(student_logits.shape)}, top-k ids {tuple(top_k_ids.shape)} and "
                         f"top-k log-probs {tuple(top_k_logprobs.shape)} must agree except in the last dimension")
    if top_k_ids.numel() and int(top_k_ids.max()) >= student_logits.shape[-1]:
        raise ValueError(f"stored token id {int(top_k_ids.max())} is outside the drafter's vocabulary of "
                         f"{student_logits.shape[-1]}")


def _student_top_and_rest(student_logits: torch.Tensor, ids: torch.Tensor,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's log-probabilities of the stored ids ``(..., k)`` and of the rest ``(..., 1)``, float32, in
    one pass over the vocabulary: the rest's log-sum-exp is taken directly over the other tokens (exact, no
    ``1 - sum`` cancellation) and the normaliser from it and the k ids' (``log Z = logaddexp(rest, top)``), so
    no ``(..., vocab)`` log-softmax is formed (with a 152k vocabulary those passes were most of a step)."""
    logits = student_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    top = logits.gather(-1, ids)
    rest = torch.logsumexp(logits.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True)
    # ids the drafter cannot produce are -inf; clamped, a row of only those stays finite (no NaN gradient)
    log_z = torch.logaddexp(rest, torch.logsumexp(top.clamp(min=-1e30), dim=-1, keepdim=True))
    return top - log_z, rest - log_z


def _coarsened(student_top: torch.Tensor, student_rest: torch.Tensor, top_k_logprobs: torch.Tensor,
               drop_impossible: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_log_probs`' ``k + 1`` buckets from the drafter's side and the stored target's."""
    target_top = top_k_logprobs.float()
    target_rest = torch.log((1.0 - target_top.exp().sum(-1, keepdim=True)).clamp(min=1e-7))
    # k covers the whole vocabulary: nothing is left over on either side
    target_rest = torch.where(torch.isneginf(student_rest), student_rest, target_rest)
    # Tokens the drafter cannot produce (probability exactly 0: a reduced-vocabulary head) leave the
    # target too, which is renormalised over the rest (EAGLE-3's restriction to the draft vocabulary,
    # Li et al. 2025); otherwise forward KL would be infinite.
    impossible = torch.isneginf(student_top)
    if drop_impossible and bool(impossible.any()):
        removed = torch.where(impossible, target_top.exp(), torch.zeros_like(target_top)).sum(-1, keepdim=True)
        scale = torch.log((1.0 - removed).clamp(min=1e-7))
        # both sides get a finite log-prob whose probability underflows to 0: -inf on both sides would
        # give NaN gradients (0 * (-inf - -inf), logsumexp over all -inf) in RKL and JSD
        floor = torch.full_like(target_top, _IMPOSSIBLE_LOGP)
        target_top = torch.where(impossible, floor, target_top - scale)
        student_top = torch.where(impossible, floor, student_top)
        target_rest = target_rest - scale
    return torch.cat([student_top, student_rest], -1), torch.cat([target_top, target_rest], -1)


def top_k_distillation_loss(
    student_logits: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_logprobs: torch.Tensor,
    *,
    kind: str,
    jsd_beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    draft_to_target: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss and expected acceptance against stored top-k target log-probabilities.

    Args:
        student_logits: ``(N, vocab)`` drafter logits at the N loss positions; with
            ``draft_to_target``, ``(N, D)`` over a reduced drafter's D kept ids only
            (:func:`distill.models.reduced_vocab.draft_vocabulary_logits`): the same result as its
            full ``(N, vocab)`` logits, ``-inf`` outside the set, at D/vocab of the softmax passes.
        top_k_ids, top_k_logprobs: ``(N, k)``, see :func:`top_k_log_probs`.
        kind, jsd_beta, temperature: as in :func:`distillation_loss` (``"ce"`` uses ``labels``
            and the full student distribution; the stored target is then unused; a label the
            drafter gives probability 0, outside a reduced vocabulary, contributes 0).
        labels: ``(N,)`` int64 next tokens, for ``kind="ce"``.
        draft_to_target: ``(D,)`` ascending target ids of ``student_logits``' columns, or None.

    Returns:
        ``(loss, acceptance)``, each ``(N,)`` float32: the divergence on the coarsened
        distributions (nats) and ``1 - TVD`` on them (an upper bound of the true acceptance
        probability, see :func:`top_k_log_probs`); acceptance carries no gradient.
    """
    _check_args(kind, jsd_beta, temperature)
    if draft_to_target is not None:  # target ids -> draft columns; the appended column is the ids outside
        top_k_ids = draft_indices(top_k_ids, draft_to_target)
        labels = None if labels is None else draft_indices(labels, draft_to_target)
        student_logits = F.pad(student_logits, (0, 1), value=float("-inf"))
    _check_top_k(student_logits, top_k_ids, top_k_logprobs, temperature)
    student_top, student_rest = _student_top_and_rest(student_logits, top_k_ids.long(), temperature)
    student_logp, target_logp = _coarsened(student_top, student_rest, top_k_logprobs, drop_impossible=True)
    if kind == "ce":
        full = F.log_softmax(student_logits.float() / temperature, dim=-1)
        loss = _cross_entropy(full, labels)
        # a label the drafter cannot produce (outside a reduced vocabulary) teaches it nothing: 0, not inf
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss)
    else:
        loss = divergence_from_log_probs(student_logp, target_logp, kind=kind, jsd_beta=jsd_beta)
    with torch.no_grad():
        if bool(torch.isneginf(student_top).any()):  # reduced vocabulary:
            # acceptance against the unrestricted target (its mass outside the set is never accepted)
            student_logp, target_logp = _coarsened(student_top.detach(), student_rest.detach(), top_k_logprobs,
                                                   drop_impossible=False)
        tvd = divergence_from_log_probs(student_logp.detach(), target_logp, kind="tvd")
    return loss, (1.0 - tvd).clamp(0.0, 1.0)


def expected_acceptance(
    student_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Probability that speculative sampling accepts a drafted token, per position.

    ``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` (Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding", Cor. 3.6; DistillSpec uses it as its main metric).
    It is the acceptance rate of *sampling* at this temperature, not of greedy decoding (greedy
    accepts iff the two argmaxes agree).

    Args:
        student_logits: ``(batch, seq, vocab_s)``; target_logits: ``(batch, seq, vocab_t)``.
        mask: ``(batch, seq)`` bool; positions where it is False get 0.
        temperature: > 0, applied to both.

    Returns:
        float32 ``(batch, seq)`` in [0, 1]; 0 where ``mask`` is False.
    """
    _check_args("tvd", 0.5, temperature)
    _check_mask(student_logits, target_logits, mask)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=student_logits.device)
    if bool(mask.any()):
        tvd = per_token_divergence(student_logits[mask], target_logits[mask], kind="tvd",
                                   temperature=temperature)
        out[mask] = (1.0 - tvd).clamp(0.0, 1.0)
    return out


def _masked_per_token(student_logits, target_logits, mask, *, kind, jsd_beta, temperature, labels):
    """Selects the masked positions first: (B, T, V) -> (N, V), so padding costs nothing and
    non-finite values at masked-out positions cannot leak into the result."""
    _check_args(kind, jsd_beta, temperature)
    _check_mask(student_logits, target_logits, mask)
    if labels is not None:
        if labels.shape != mask.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the mask's shape {tuple(mask.shape)}")
        labels = labels[mask]
    return per_token_divergence(student_logits[mask], target_logits[mask], kind=kind, jsd_beta=jsd_beta,
                                temperature=temperature, labels=labels)


def _cross_entropy(student_logp: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    if labels is None:
        raise ValueError("kind='ce' needs labels (the target's tokens, shifted by one)")
    if labels.numel() and int(labels.max()) >= student_logp.shape[-1]:
        raise ValueError(f"label {int(labels.max())} is outside the common vocabulary of "
                         f"{student_logp.shape[-1]} tokens")
    return -student_logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def _log_probs(student_logits, target_logits, temperature):
    vocab = min(student_logits.shape[-1], target_logits.shape[-1])
    student_logp = F.log_softmax(student_logits[..., :vocab].float() / temperature, dim=-1)
    target_logp = F.log_softmax(target_logits[..., :vocab].float() / temperature, dim=-1)
    return student_logp, target_logp


def _kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) = sum_v a (log a - log b) over the last dim; terms with a_v = 0 count 0."""
    prob_a = logp_a.exp()
    terms = prob_a * (logp_a - logp_b)
    # zero only exact zeros (log a = -inf): a NaN must stay NaN so the caller can see it
    return torch.where(prob_a == 0, torch.zeros_like(terms), terms).sum(-1)


def _check_args(kind: str, jsd_beta: float, temperature: float) -> None:
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss kind must be one of {LOSS_KINDS}, got {kind!r}")
    if not 0.0 <= jsd_beta <= 1.0:
        raise ValueError(f"jsd_beta must be in [0, 1], got {jsd_beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_mask(student_logits, target_logits, mask) -> None:
    if student_logits.dim() != 3 or target_logits.dim() != 3:
        raise ValueError("logits must be (batch, seq, vocab), got "
                         f"{tuple(student_logits.shape)} and {tuple(target_logits.shape)}")
    if student_logits.shape[:2] != target_logits.shape[:2] or tuple(mask.shape) != tuple(student_logits.shape[:2]):
        raise ValueError(f"shapes disagree: student {tuple(student_logits.shape)}, target "
                         f"{tuple(target_logits.shape)}, mask {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
