"""Speculative decoding with an EAGLE-3 head, batch size 1: the head drafts from the target's own states.

Each block: the head first takes in the entries whose target states the last verification produced (the
accepted tokens' and the one before them), which gives the first draft; then it drafts K - 1 more from its
own output states. The target verifies ``[last token, d_1..d_K]`` in one forward that also returns its
aux-layer states; acceptance is ``decode.sampling``'s, as in ``decode.speculative`` (Leviathan et al.
2023, Alg. 1), so greedy output equals the target's and sampled output follows its distribution.

Cache invariant, with ``seq`` = prompt + emitted tokens of length L: between blocks the target's cache
holds ``seq[:-1]``; the head's holds entries ``0..first - 1`` built from the target's states, and the
states of entries ``first..L - 2`` are pending (entry s pairs the target's state at s with ``seq[s + 1]``).
The head's draft entries of a block are dropped at its end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from decode.eagle3.features import aux_states_of
from decode.eagle3.head import Eagle3Head
from decode.metrics import DecodeStats
from decode.model_calls import crop, forward, sync, vocab_size_of
from decode.sampling import check_sampling_args, greedy_accept, process_logits, speculative_accept
from decode.speculative import SpeculativeOutput, check_decode_args, draw_draft, finished_output


class HeadDrafter:
    """The head, its cache and the target states it has not taken in yet, for one generation.

    Args:
        head: the EAGLE-3 head; embed_tokens: the target's input embedding.
    """

    def __init__(self, head: Eagle3Head, embed_tokens):
        self.head, self.embed_tokens = head, embed_tokens
        self.cache = DynamicCache()
        self.pending: torch.Tensor | None = None  # (n, 3 * hidden) target states of entries len(cache)..

    def add_states(self, states: torch.Tensor) -> None:
        """Target aux states ``(n, 3 * hidden)`` of the next entries."""
        self.pending = states if self.pending is None else torch.cat([self.pending, states])

    def draft(self, seq: list[int], k: int, vocab: int, greedy: bool, probs_of, generator
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Up to ``k`` draft target ids ``(k,)`` after ``seq`` and (sampling) the ``(1, vocab)``
        distribution each was drawn from; none while no target state is known (a one-token prompt)."""
        device = self.head.device
        if k == 0 or self.pending is None:
            return torch.zeros(0, dtype=torch.long, device=device), []
        first = self.cache.get_seq_length()
        count = self.pending.shape[0]
        tokens = torch.tensor([seq[first + 1: first + 1 + count]], device=device)
        positions = torch.arange(first, first + count, device=device).unsqueeze(0)
        logits, hidden = self.head.cached_step(self.embed_tokens(tokens), self.head.fuse(self.pending[None]),
                                               positions, self.cache)
        self.pending = None
        draft_tokens, draft_probs = [], []
        for j in range(k):
            token = draw_draft(self.head.full_vocab_logits(logits[0, -1:]), vocab, greedy, probs_of, generator,
                               draft_probs)
            draft_tokens.append(token)
            if j + 1 < k:
                position = torch.tensor([[first + count + j]], device=device)
                logits, hidden = self.head.cached_step(self.embed_tokens(token.view(1, 1)), hidden[:, -1:],
                                                       position, self.cache)
        return torch.cat(draft_tokens), draft_probs

    def end_block(self, seq_length_before: int) -> None:
        """Drop the block's draft entries: keep the entries built from target states (``0..L - 2``)."""
        crop(self.cache, seq_length_before - 1)


@torch.inference_mode()
def eagle3_generate(target, head: Eagle3Head, input_ids: torch.Tensor, *, draft_length: int, max_new_tokens: int,
                    eos_token_ids: Sequence[int], temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    generator: torch.Generator | None = None) -> SpeculativeOutput:
    """Generate with an EAGLE-3 head drafting K tokens a block; lossless as ``speculative_generate``.

    Args:
        target: causal LM (transformers ``PreTrainedModel``) in eval mode; the head's target.
        head: ``Eagle3Head`` on the target's device, its ``vocab_size`` the target's.
        input_ids: ``(1, prompt_len)`` LongTensor, prompt_len >= 1 (a one-token prompt's first block
            drafts nothing: the head needs a target state).
        draft_length: K >= 1 (fewer when fewer than K + 1 tokens remain before ``max_new_tokens``).
        max_new_tokens, eos_token_ids, temperature, top_k, top_p, generator: as in ``speculative_generate``.

    Returns:
        ``SpeculativeOutput``; ``stats.decode_s`` excludes the prompt prefill.

    Raises:
        ValueError: bad shapes or arguments, or a head whose vocabulary is not the target's.
    """
    check_decode_args(input_ids, max_new_tokens)
    check_sampling_args(temperature, top_k, top_p)
    if draft_length < 1:
        raise ValueError(f"draft_length must be >= 1, got {draft_length}")
    vocab = vocab_size_of(target)
    if head.config.vocab_size != vocab:
        raise ValueError(f"the head drafts over {head.config.vocab_size} tokens, the target has {vocab}: "
                         f"train the head for this target")
    device, greedy, eos, aux = target.device, temperature == 0, set(eos_token_ids), head.config.aux_layers
    drafter, stats = HeadDrafter(head, target.get_input_embeddings()), DecodeStats(draft_length=draft_length)

    def probs_of(logits):  # (n, V) -> float32 (n, V)
        return process_logits(logits[:, :vocab], temperature, top_k, top_p)

    # the aux-layer hooks stay on for the whole generation: one registration, not one per forward
    with aux_states_of(target, aux) as collected:
        start = time.perf_counter()
        target_cache = DynamicCache()
        if input_ids.shape[1] > 1:
            forward(target, input_ids[:, :-1], target_cache, last_only=True)
            drafter.add_states(collected.pop()[0])
        sync(device)
        stats.prefill_s, start = time.perf_counter() - start, time.perf_counter()

        seq = input_ids[0].tolist()
        prompt_len = len(seq)
        while len(seq) - prompt_len < max_new_tokens:
            k = min(draft_length, max_new_tokens - (len(seq) - prompt_len) - 1)
            draft_tokens, draft_probs = drafter.draft(seq, k, vocab, greedy, probs_of, generator)
            k = len(draft_tokens)
            stats.draft_forwards += k

            verify_input = torch.cat([torch.tensor(seq[-1:], device=device), draft_tokens]).unsqueeze(0)
            target_logits, states = forward(target, verify_input, target_cache), collected.pop()[0]
            stats.target_forwards += 1
            if greedy:
                num_accepted, next_token = greedy_accept(target_logits[:, :vocab].argmax(-1), draft_tokens)
            else:
                draft_probs = torch.cat(draft_probs) if k else torch.zeros(0, vocab, device=device)
                num_accepted, next_token = speculative_accept(probs_of(target_logits), draft_probs, draft_tokens,
                                                              generator)

            *block, n = torch.cat([draft_tokens, next_token.view(1), num_accepted.view(1)]).tolist()
            block = block[:n] + block[k:]
            stop = next((i for i, token in enumerate(block) if token in eos), None)
            emitted_before, length_before = len(seq) - prompt_len, len(seq)
            seq += block if stop is None else block[: stop + 1]
            stats.accepted_per_block.append(min(n, len(seq) - prompt_len - emitted_before - 1))
            stats.drafted_per_block.append(k)

            crop(target_cache, len(seq) - 1)
            drafter.end_block(length_before)
            drafter.add_states(states[: n + 1])  # entries L-1 .. L+n-1: the last token's and the accepted drafts'
            if stop is not None:
                break

    return finished_output(seq, prompt_len, stats, start, device)
