"""Exact acceptance of an EAGLE-3 head from one teacher-forced target pass, block by block.

A sibling drafter's j-th draft depends only on the context, so one pass fixes every block
(``decode.acceptance``). A head's j-th draft also depends on where its block started: from step 2 on it
reads its own state. So the head's K steps are unrolled at every possible block start
(``decode.eagle3.unroll``) and the decoder's blocks are replayed over them: a block starting at answer
position p accepts the leading run of its drafts that equal the answer's tokens. Greedy: exact, equal to
``eagle3_generate``'s blocks in float32 (up to near-ties between the whole-sequence and the incremental
forward). Sampling: the expectation along a sampled answer with ``beta = 1 - TV`` per block start and
step, the same approximation as ``decode.acceptance.expected_sampling_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decode.acceptance import MAX_SIMULATED_K, BlockTotals, TeacherForced
from decode.draft_length import make_schedule
from decode.eagle3.features import teacher_forced_states
from decode.eagle3.head import Eagle3Head
from decode.eagle3.unroll import unroll
from decode.metrics import DecodeStats
from decode.sampling import process_logits


def _start_entry(prompt_len: int, p: int) -> int:
    """The head entry whose step-1 output is the first draft of a block starting at answer position p."""
    return prompt_len + p - 2


@torch.inference_mode()
def head_block_drafts(target, head: Eagle3Head, prompt: Sequence[int], answer: Sequence[int], steps: int,
                      *, sampling: dict | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
    """The head's drafts at every block start of ``answer``, and (sampling) their acceptance probabilities.

    Args:
        target, head: the target and its head, on one device.
        prompt, answer: token ids; the answer is the target's (greedy, or sampled for ``sampling``).
        steps: K, the drafts per block start.
        sampling: ``{"temperature", "top_k", "top_p"}`` to also return ``beta = 1 - TV(target, head)`` of
            each draft (processed distributions, as the decoder draws them); None for greedy.

    Returns:
        ``drafts[p][j]``: the target id of the (j+1)-th draft of a block starting at answer position p
        (``[]`` where the block can have none: a one-token prompt's first block); ``betas[p][j]`` or None.
    """
    ids = torch.tensor([list(prompt) + list(answer)], device=target.device)
    target_logits, states = teacher_forced_states(target, ids, head.config.aux_layers,
                                                  logits_to_keep=0 if sampling else 1)
    starts = [_start_entry(len(prompt), p) for p in range(len(answer))]
    wanted = torch.tensor([s for s in starts if s >= 0], dtype=torch.long, device=ids.device)
    outputs = unroll(head, target.get_input_embeddings(), ids, states, steps, entries=wanted)
    logits = [head.lm_head(normed[0]).float() for normed in outputs]  # steps x (n, N), rows as `wanted`
    best = torch.stack([head.draft_to_target[step.argmax(-1)] for step in logits], dim=-1).tolist()  # (n, steps)
    vocab = head.config.vocab_size
    drafts, betas, row = [], [] if sampling else None, 0
    for s in starts:
        if s < 0:
            drafts.append([])
            if sampling:
                betas.append([])
            continue
        drafts.append(best[row])
        if sampling:
            full = [head.full_vocab_logits(step[row: row + 1]) for step in logits]
            betas.append(_betas(target_logits[0], full, s, vocab, sampling))
        row += 1
    return drafts, betas


def _betas(target_logits: torch.Tensor, full: list[torch.Tensor], s: int, vocab: int, sampling: dict
           ) -> list[float]:
    """``1 - TV`` of each step at start entry ``s`` (``full``: each step's ``(1, V)`` logits there): step j
    predicts the token after position ``s + j + 1``."""
    out = []
    for j, logits in enumerate(full):
        position = s + j + 1
        if position >= target_logits.shape[0]:
            break
        target_probs = process_logits(target_logits[position: position + 1, :vocab].float(), **sampling)
        draft_probs = process_logits(logits[:, :vocab], **sampling)
        out.append(float(torch.minimum(target_probs, draft_probs).sum()))
    return out


def simulate_head_greedy(drafts: Sequence[Sequence[int]], answer: Sequence[int], *, draft_length: int,
                         max_new_tokens: int, schedule: str = "constant",
                         max_draft_length: int | None = None) -> DecodeStats:
    """The blocks greedy ``eagle3_generate`` makes while emitting ``answer`` (the target's greedy answer up to
    its EOS or ``max_new_tokens``), from ``head_block_drafts``'s drafts. A ``heuristic`` schedule
    (``decode.draft_length``) is replayed with K capped at the steps unrolled.

    Raises:
        ValueError: an answer longer than ``max_new_tokens``, drafts shorter than a constant ``draft_length``,
            or a schedule error.
    """
    n = len(answer)
    if n > max_new_tokens:
        raise ValueError(f"the answer has {n} tokens, more than max_new_tokens={max_new_tokens}")
    plan = make_schedule(schedule, draft_length, max_draft_length)
    stats, p = DecodeStats(draft_length=draft_length), 0
    while p < n:
        block = drafts[p]
        k = min(plan.next_length(), max_new_tokens - p - 1) if block else 0
        if len(block) < k:
            if schedule == "constant":
                raise ValueError(f"{len(block)} drafts at answer position {p}, K = {k} needs them all")
            k = len(block)
        accepted = 0
        while accepted < k and p + accepted < n and block[accepted] == answer[p + accepted]:
            accepted += 1
        plan.update(k, accepted)
        accepted = min(accepted, n - p - 1)  # a matched EOS is the block's +1
        stats.accepted_per_block.append(accepted)
        stats.drafted_per_block.append(k)
        p += accepted + 1
    stats.new_tokens, stats.target_forwards = n, len(stats.accepted_per_block)
    return stats


@dataclass
class HeadTeacherForced(TeacherForced):
    """``decode.acceptance.TeacherForced`` for a head: its drafts per block start, so that every figure of
    ``decode.acceptance`` (``simulate``, ``simulated_section``, pairing) replays the head's blocks.

    Attributes:
        drafts_by_start: ``drafts[p][j]`` (``head_block_drafts``); ``draft_tokens`` holds the first drafts.
        betas_by_start: ``betas[p][j]`` for sampling, else None.
    """

    drafts_by_start: list[list[int]] = field(default_factory=list)
    betas_by_start: list[list[float]] | None = None

    def greedy_blocks(self, *, draft_length: int, max_new_tokens: int, schedule: str = "constant",
                      max_draft_length: int | None = None, confidence_threshold: float = 0.0) -> DecodeStats:
        if confidence_threshold > 0:
            raise ValueError("a confidence threshold is not simulated for an EAGLE-3 head (eagle3_generate has none)")
        return simulate_head_greedy(self.drafts_by_start, self.answer, draft_length=draft_length,
                                    max_new_tokens=max_new_tokens, schedule=schedule,
                                    max_draft_length=max_draft_length)

    def sampling_blocks(self, *, draft_length: int, max_new_tokens: int) -> BlockTotals:
        return expected_head_sampling_blocks(self.betas_by_start, draft_length=draft_length,
                                             max_new_tokens=max_new_tokens)


def head_teacher_forced(target, head: Eagle3Head, prompt_id: str, category: str, prompt: Sequence[int],
                        answer: Sequence[int], steps: int = MAX_SIMULATED_K,
                        sampling: dict | None = None) -> HeadTeacherForced:
    """One prompt's :class:`HeadTeacherForced` from ``head_block_drafts`` (``steps`` drafts per block start)."""
    drafts, betas = head_block_drafts(target, head, prompt, answer, steps, sampling=sampling)
    return HeadTeacherForced(prompt_id, category, list(prompt), list(answer),
                             draft_tokens=[d[0] if d else -1 for d in drafts],
                             betas=[b[0] if b else 0.0 for b in betas] if betas is not None else None,
                             drafts_by_start=drafts, betas_by_start=betas)


def expected_head_sampling_blocks(betas: Sequence[Sequence[float]], *, draft_length: int,
                                  max_new_tokens: int) -> BlockTotals:
    """E[blocks] and E[drafted] of speculative sampling with the head along an answer of ``len(betas)``
    tokens, draft j of a block at p accepted with probability ``betas[p][j]`` given the earlier ones
    (Leviathan et al. 2023, Sec. 3): ``decode.acceptance.expected_sampling_blocks`` with start-dependent
    betas.

    Raises:
        ValueError: an answer longer than ``max_new_tokens`` or a beta outside [0, 1].
    """
    n = len(betas)
    if n > max_new_tokens:
        raise ValueError(f"the answer has {n} tokens, more than max_new_tokens={max_new_tokens}")
    if any(not 0.0 <= b <= 1.0 + 1e-6 for row in betas for b in row):
        raise ValueError("betas must lie in [0, 1]")
    blocks, drafted = [0.0] * (n + 1), [0.0] * (n + 1)
    for p in range(n - 1, -1, -1):
        k = min(draft_length, max_new_tokens - p - 1) if betas[p] else 0
        survive, e_blocks, e_drafted = 1.0, 1.0, float(k)
        for accepted in range(k + 1):
            inside = accepted < k and p + accepted < n and accepted < len(betas[p])
            stop = 1.0 - betas[p][accepted] if inside else 1.0
            prob, nxt = survive * stop, min(p + accepted + 1, n)
            e_blocks += prob * blocks[nxt]
            e_drafted += prob * drafted[nxt]
            survive *= 1.0 - stop
            if p + accepted + 1 >= n:
                e_blocks += survive * blocks[n]
                e_drafted += survive * drafted[n]
                break
        blocks[p], drafted[p] = e_blocks, e_drafted
    return BlockTotals(tokens=n, blocks=blocks[0], drafted=drafted[0])
