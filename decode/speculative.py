"""Speculative decoding loop and a plain autoregressive baseline, batch size 1.

The drafter proposes K tokens one at a time from its KV cache, the target
checks them all in ONE forward, accepted tokens are kept and both caches are
cropped back to the accepted prefix (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling"). Layout after
gpt-fast's ``speculative_decode``.

Cache invariant, with ``seq`` = prompt + emitted tokens: between blocks the
target's cache holds ``seq[:-1]`` (the last token is fed at the next
forward). The drafter's holds the same, or one token fewer after a fully
accepted block: its last draft was never fed, and is fed together with the
pending token at the next block's first drafter forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from decode.draft_length import make_schedule
from decode.metrics import DecodeStats
from decode.model_calls import crop, forward, prefill, sync, vocab_size_of
from decode.prompt_lookup import PromptLookupDrafter
from decode.sampling import check_sampling_args, greedy_accept, process_logits, sample, speculative_accept
from decode.stopping import StopStrings


@dataclass
class SpeculativeOutput:
    """Tokens and statistics of one generation.

    Attributes:
        new_tokens: LongTensor ``(n,)`` on the target's device, prompt
            excluded, ``n <= max_new_tokens``; ends with the EOS if one stopped it.
        stats: acceptance counts and timings.
    """

    new_tokens: torch.Tensor
    stats: DecodeStats


def finished_output(seq: list[int], prompt_len: int, stats: DecodeStats, start: float,
                    device: torch.device) -> SpeculativeOutput:
    """The generation's output once its loop ends: the tokens after the prompt, ``stats`` completed with the
    decode time since ``start`` (``time.perf_counter()``) and the token count."""
    sync(device)
    stats.decode_s = time.perf_counter() - start
    stats.new_tokens = len(seq) - prompt_len
    return SpeculativeOutput(torch.tensor(seq[prompt_len:], dtype=torch.long, device=device), stats)


def check_decode_args(input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """Raises ValueError unless ``input_ids`` is ``(1, prompt_len >= 1)`` and ``max_new_tokens >= 0``."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, prompt_len >= 1), got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def draw_draft(logits: torch.Tensor, vocab: int, greedy: bool, probs_of, generator,
               draft_probs: list[torch.Tensor]) -> torch.Tensor:
    """The draft token per row ``(rows,)`` from drafter logits ``(rows, V)``: the argmax over the first ``vocab``
    (greedy), or a sample from ``probs_of(logits)``, which is appended to ``draft_probs``."""
    if greedy:
        return logits[:, :vocab].argmax(-1)
    draft_probs.append(probs_of(logits))
    return sample(draft_probs[-1], generator)


def _draft(drafter, cache: DynamicCache, seq: list[int], k: int, vocab: int, device, greedy: bool, probs_of,
           generator, confidence_threshold: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Up to ``k`` draft tokens ``(n,)`` from a model drafter, one cached forward each, and (sampling) the
    ``(1, vocab)`` distribution each was drawn from; stops early below ``confidence_threshold``."""
    draft_input = torch.tensor([seq[cache.get_seq_length():]], device=drafter.device)
    draft_tokens, draft_probs = [], []
    for _ in range(k):
        logits = forward(drafter, draft_input, cache, last_only=True).to(device)
        token = draw_draft(logits, vocab, greedy, probs_of, generator, draft_probs)
        draft_tokens.append(token)
        draft_input = token.view(1, 1).to(drafter.device)
        if confidence_threshold > 0:
            probs = torch.softmax(logits[:, :vocab].float(), -1) if greedy else draft_probs[-1]
            if float(probs[0, token]) < confidence_threshold:
                break
    tokens = torch.cat(draft_tokens) if draft_tokens else torch.zeros(0, dtype=torch.long, device=device)
    return tokens, draft_probs


@torch.inference_mode()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    *,
    draft_length: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    schedule: str = "constant",
    max_draft_length: int | None = None,
    confidence_threshold: float = 0.0,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
) -> SpeculativeOutput:
    """Generate with speculative decoding; the output follows the target's distribution.

    Each block: the drafter samples ``K`` tokens one at a time from its
    ``DynamicCache``; the target scores ``[last token, d_1..d_K]`` in one
    forward; drafts are accepted by ``greedy_accept`` (temperature 0: output
    identical to greedy ``target_generate``, up to floating-point ties) or
    ``speculative_accept`` (Leviathan et al. 2023, Alg. 1); one correction or
    bonus token follows; both caches are cropped to the accepted prefix.
    Probabilities are computed in float32 over the common vocabulary
    ``min(V_target, V_draft)`` (rows past it are embedding padding), so the
    models may differ in dtype and padded vocabulary size.

    Args:
        target, drafter: causal LMs (transformers ``PreTrainedModel``) sharing
            a tokenizer, in eval mode, on the same device.
        input_ids: ``(1, prompt_len)`` LongTensor, prompt_len >= 1.
        draft_length: K >= 1 tokens drafted per block (fewer when fewer than
            K + 1 tokens remain before ``max_new_tokens``); the starting K
            of an adaptive ``schedule``.
        max_new_tokens: upper bound on emitted tokens, never exceeded.
        eos_token_ids: generation stops at the first of these; it is emitted,
            nothing after it.
        temperature, top_k, top_p: as in ``decode.sampling.process_logits``,
            applied to both models; temperature 0 is greedy.
        generator: randomness for temperature > 0, on the models' device;
            None uses torch's global generator. Unused when greedy.
        schedule: ``constant`` (K every block) or ``heuristic`` (transformers'
            rule: K + 2 after a fully accepted block, else K - 1, min 1); see
            ``decode.draft_length``.
        max_draft_length: cap on K for the heuristic schedule (None = uncapped).
        confidence_threshold: stop drafting a block after a draft token whose
            drafter probability is below this (greedy: softmax of the raw
            logits; sampling: the processed distribution it was drawn from),
            as transformers' ``assistant_confidence_threshold``; 0 = off.
            Changes only speed, never the output.
        stop_strings: stop after the token completing any of these texts
            (kept in the output, as in transformers); needs ``tokenizer``.
        tokenizer: decodes tokens for ``stop_strings``.

    Returns:
        ``SpeculativeOutput``; ``stats.decode_s`` excludes the prompt prefill.

    Raises:
        ValueError: bad shapes or arguments out of range.
    """
    check_decode_args(input_ids, max_new_tokens)
    if not 0.0 <= confidence_threshold < 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
    draft_schedule = make_schedule(schedule, draft_length, max_draft_length)
    stopper = StopStrings(stop_strings, tokenizer)
    check_sampling_args(temperature, top_k, top_p)
    device, greedy, eos = target.device, temperature == 0, set(eos_token_ids)
    lookup = isinstance(drafter, PromptLookupDrafter)
    vocab = vocab_size_of(target) if lookup else min(vocab_size_of(target), vocab_size_of(drafter))
    stats = DecodeStats(draft_length=draft_length)

    def probs_of(logits):  # (n, V_model) -> float32 (n, vocab)
        return process_logits(logits[:, :vocab], temperature, top_k, top_p)

    start = time.perf_counter()
    target_cache, draft_cache = prefill(target, input_ids), None if lookup else prefill(drafter, input_ids)
    sync(device)
    stats.prefill_s = time.perf_counter() - start
    start = time.perf_counter()

    seq = input_ids[0].tolist()  # prompt + emitted tokens, on the host
    prompt_len = len(seq)
    while len(seq) - prompt_len < max_new_tokens:
        k = min(draft_schedule.next_length(), max_new_tokens - (len(seq) - prompt_len) - 1)
        # 1. Draft up to k tokens (the model's first forward also feeds what it has not seen yet).
        if lookup:
            draft_tokens = torch.tensor(drafter.propose(seq, k), dtype=torch.long, device=device)
            draft_probs = [torch.nn.functional.one_hot(draft_tokens, vocab).float()] if len(draft_tokens) else []
        else:
            draft_tokens, draft_probs = _draft(drafter, draft_cache, seq, k, vocab, device, greedy, probs_of,
                                               generator, confidence_threshold)
            stats.draft_forwards += len(draft_tokens)
        k = len(draft_tokens)

        # 2. Verify [last token, d_1..d_k] in one target forward: k+1 next-token distributions.
        verify_input = torch.cat([torch.tensor(seq[-1:], device=device), draft_tokens]).unsqueeze(0)
        target_logits = forward(target, verify_input, target_cache)
        stats.target_forwards += 1
        if greedy:
            num_accepted, next_token = greedy_accept(target_logits[:, :vocab].argmax(-1), draft_tokens)
        else:
            draft_probs = torch.cat(draft_probs) if k else torch.zeros(0, vocab, device=device)
            num_accepted, next_token = speculative_accept(
                probs_of(target_logits), draft_probs, draft_tokens, generator)

        # 3. Emit accepted drafts + correction/bonus (one host sync), stop at EOS.
        *block, n = torch.cat([draft_tokens, next_token.view(1), num_accepted.view(1)]).tolist()
        block = block[:n] + block[k:]
        draft_schedule.update(k, n)
        stop = next((i for i, token in enumerate(block) if token in eos), None)
        checked = len(seq) - prompt_len
        seq += block if stop is None else block[: stop + 1]
        if stopper:
            text_stop = stopper.first_stop(seq[prompt_len:], checked)
            if text_stop is not None:
                del seq[prompt_len + text_stop + 1:]
                stop = text_stop
        # drafts accepted past an EOS or stop string are not output: the stopping token is the block's +1
        stats.accepted_per_block.append(min(n, len(seq) - prompt_len - checked - 1))
        stats.drafted_per_block.append(k)

        # 4. Roll back: both caches keep at most seq[:-1] (rejected drafts are dropped).
        crop(target_cache, len(seq) - 1)
        if draft_cache is not None:
            crop(draft_cache, len(seq) - 1)
        if stop is not None:
            break

    return finished_output(seq, prompt_len, stats, start, device)


@torch.inference_mode()
def target_generate(
    target,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
) -> SpeculativeOutput:
    """Plain autoregressive decoding with a ``DynamicCache``: the baseline for speedups.

    Same prefill, sampling, stopping rules and timing as
    ``speculative_generate``, one target forward per token.

    Args:
        target: causal LM (transformers ``PreTrainedModel``), in eval mode.
        input_ids: ``(1, prompt_len)`` LongTensor, prompt_len >= 1.
        max_new_tokens: upper bound on emitted tokens.
        eos_token_ids: generation stops at the first of these (emitted).
        temperature, top_k, top_p: as in ``decode.sampling.process_logits``.
        generator: randomness for temperature > 0; None = torch's global one.
        vocab_size: sample only among the first ``vocab_size`` token ids (pass
            ``min(V_target, V_draft)`` to compare with ``speculative_generate``
            token for token); None = the target's full vocabulary.
        stop_strings, tokenizer: as in ``speculative_generate``.

    Returns:
        ``SpeculativeOutput`` with ``draft_length`` 0 and one block per token.

    Raises:
        ValueError: bad shapes or arguments out of range.
    """
    check_decode_args(input_ids, max_new_tokens)
    check_sampling_args(temperature, top_k, top_p)
    stopper = StopStrings(stop_strings, tokenizer)
    device, eos = target.device, set(eos_token_ids)
    vocab = vocab_size or vocab_size_of(target)
    stats = DecodeStats(draft_length=0)

    start = time.perf_counter()
    cache = prefill(target, input_ids)
    sync(device)
    stats.prefill_s = time.perf_counter() - start
    start = time.perf_counter()

    token = input_ids[:, -1:].to(device)
    new_tokens, host_tokens = [], []
    for _ in range(max_new_tokens):
        logits = forward(target, token, cache, last_only=True)[:, :vocab]
        token = logits.argmax(-1) if temperature == 0 else sample(
            process_logits(logits, temperature, top_k, top_p), generator)
        new_tokens.append(token)
        token = token.view(1, 1)
        stats.target_forwards += 1
        if eos or stopper:  # one host sync per token, as any stopping rule needs
            host_tokens.append(int(token))
            if host_tokens[-1] in eos or stopper.first_stop(host_tokens, len(host_tokens) - 1) is not None:
                break

    sync(device)
    stats.decode_s = time.perf_counter() - start
    stats.new_tokens = len(new_tokens)
    stats.accepted_per_block = [0] * len(new_tokens)
    stats.drafted_per_block = [0] * len(new_tokens)
    out = torch.cat(new_tokens) if new_tokens else torch.zeros(0, dtype=torch.long, device=device)
    return SpeculativeOutput(out, stats)
