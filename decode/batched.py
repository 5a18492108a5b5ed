"""Speculative decoding of several prompts at once (batch > 1), lossless per row.

Rows have different prompt lengths and accept different numbers of drafts.
This decoder keeps one rectangular KV cache per model: prompts are
left-padded (attention mask zero on the padding, per-row position ids), and
after each verification every active row advances by the same number of
tokens, ``n + 1`` with ``n`` = the smallest number of drafts any active row
accepted. A row that accepted more simply keeps fewer of its accepted drafts
this block: the tokens it keeps are still exactly what the target would emit
(greedy: the target's own argmax at every kept position; sampling: every kept
token is an accepted draft or the correction, so each follows the target's
distribution given its prefix), and the next block drafts again from there.
Finished rows (EOS, stop string or ``max_new_tokens``) are dropped from both
caches, so they cost nothing afterwards.

Limits: the synchronised advance wastes the extra accepted drafts of the
better rows (block efficiency falls towards the batch's worst row as the
batch grows); padding costs compute on short prompts; one draft length for
the whole batch. For batch size 1 use ``decode.speculative.speculative_generate``,
which this reduces to.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from decode.metrics import DecodeStats
from decode.model_calls import forward_parameters, sync, vocab_size_of
from decode.sampling import check_sampling_args, process_logits, speculative_accept
from decode.speculative import SpeculativeOutput, draw_draft
from decode.stopping import StopStrings


def _batched_forward(model, input_ids, cache, attention_mask, positions, last_only=False) -> torch.Tensor:
    """Cached forward of ``input_ids`` ``(B, n)``; ``attention_mask`` ``(B, past + n)``; logits ``(B, n or 1, V)``."""
    parameters = forward_parameters(type(model))
    kwargs = {"cache" if "cache" in parameters else "past_key_values": cache, "use_cache": True}
    if last_only and "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **kwargs).logits
    return out[:, -1:] if last_only else out


@torch.inference_mode()
def speculative_generate_batch(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    draft_length: int,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
) -> list[SpeculativeOutput]:
    """Speculative decoding of ``len(prompts)`` prompts in one batch; each row as if decoded alone.

    Args:
        target, drafter: causal LMs sharing a tokenizer, eval mode, same device,
            accepting ``attention_mask`` and ``position_ids`` (all decoder-only
            transformers models do).
        prompts: token-id lists, each non-empty; lengths may differ.
        draft_length: K >= 1 drafts per block for the whole batch.
        max_new_tokens: per row, never exceeded.
        eos_token_ids: a row stops at the first of these (emitted).
        pad_token_id: id fed at padding positions (masked out, any valid id).
        temperature, top_k, top_p: as in ``decode.sampling.process_logits``; 0 = greedy.
        generator: randomness when sampling (rows draw from it in turn).
        stop_strings, tokenizer: as in ``speculative_generate``.

    Returns:
        one ``SpeculativeOutput`` per prompt, in order: ``new_tokens`` ``(n_i,)``
        and stats. Per-row ``accepted_per_block`` counts the drafts the row
        kept (the batch minimum while it was active); ``prefill_s`` and
        ``decode_s`` are the batch's, the same in every row.

    Raises:
        ValueError: no prompts, an empty prompt, or arguments out of range.
    """
    # One function on purpose, like speculative_generate: the loop's four numbered steps share the per-row
    # state (active rows, caches, left padding, positions, the sequences) and read top to bottom as the
    # algorithm; split into helpers, each would take and return most of it.
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("speculative_generate_batch needs at least one prompt, none of them empty")
    if draft_length < 1:
        raise ValueError(f"draft_length must be >= 1, got {draft_length}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling_args(temperature, top_k, top_p)
    stopper = StopStrings(stop_strings, tokenizer)
    device, greedy, eos = target.device, temperature == 0, set(eos_token_ids)
    vocab = min(vocab_size_of(target), vocab_size_of(drafter))
    batch = len(prompts)
    stats = [DecodeStats(draft_length=draft_length) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]

    # Left padding: every row ends at the same column, so one cache length serves all rows.
    width = max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    seq = torch.full((batch, width), pad_token_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        seq[i, width - len(p):] = torch.tensor(list(p), device=device)
    rows = list(range(batch))  # original index of each active row

    def mask(n_columns: int) -> torch.Tensor:  # (active, n_columns): 0 on left padding
        return (torch.arange(n_columns, device=device)[None] >= pads[:, None]).long()

    def positions(start: int, n: int) -> torch.Tensor:  # (active, n) per-row positions of columns start..start+n
        return (torch.arange(start, start + n, device=device)[None] - pads[:, None]).clamp_min(0)

    def probs_of(logits):
        return process_logits(logits[..., :vocab], temperature, top_k, top_p)

    start = time.perf_counter()
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    if width > 1:
        for model, cache in ((target, target_cache), (drafter, draft_cache)):
            _batched_forward(model, seq[:, :-1], cache, mask(width - 1), positions(0, width - 1), last_only=True)
    sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()

    emitted = 0  # tokens emitted by every active row so far (they advance together)
    while rows and emitted < max_new_tokens:
        length = seq.shape[1]
        k = min(draft_length, max_new_tokens - emitted - 1)
        # 1. Draft k tokens for every active row.
        seen = draft_cache.get_seq_length()
        draft_input = seq[:, seen:]
        draft_tokens, draft_probs = [], []
        for step in range(k):
            n_cols = draft_input.shape[1]
            logits = _batched_forward(drafter, draft_input, draft_cache, mask(seen + n_cols),
                                      positions(seen, n_cols), last_only=True)[:, 0].to(device)
            token = draw_draft(logits, vocab, greedy, probs_of, generator, draft_probs)
            draft_tokens.append(token)
            seen += n_cols
            draft_input = token[:, None]
        drafts = torch.stack(draft_tokens, 1) if k else torch.zeros(len(rows), 0, dtype=torch.long, device=device)

        # 2. Verify [last token, d_1..d_k] for all rows in one target forward.
        verify_input = torch.cat([seq[:, -1:], drafts], 1)
        logits = _batched_forward(target, verify_input, target_cache, mask(length + k), positions(length - 1, k + 1))
        if greedy:
            choice = logits[..., :vocab].argmax(-1)  # (B, k+1)
            matches = (choice[:, :k] == drafts).long().cumprod(1).sum(1)  # accepted per row
            n = int(matches.min())
            block = choice[:, : n + 1]  # target argmax at each kept position
        else:
            q = torch.stack(draft_probs, 1) if k else torch.zeros(len(rows), 0, vocab, device=device)
            p = probs_of(logits)
            per_row = [speculative_accept(p[r], q[r], drafts[r], generator) for r in range(len(rows))]
            matches = torch.stack([a for a, _ in per_row])
            n = int(matches.min())
            corrections = torch.stack([t.view(()) for _, t in per_row])
            # rows that accepted more than n keep their (accepted) draft at position n
            last = torch.where(matches > n, drafts[:, n] if n < k else corrections, corrections)
            block = torch.cat([drafts[:, :n], last[:, None]], 1)

        # 3. Emit the block per row; find rows that finished.
        block_host = block.tolist()
        finished = []
        for r, original in enumerate(rows):
            tokens = block_host[r]
            stop = next((i for i, t in enumerate(tokens) if t in eos), None)
            checked = len(outputs[original])
            outputs[original] += tokens if stop is None else tokens[: stop + 1]
            if stopper:
                text_stop = stopper.first_stop(outputs[original], checked)
                if text_stop is not None:
                    del outputs[original][text_stop + 1:]
                    stop = text_stop
            s = stats[original]
            # drafts kept (the row may have accepted more); a stop ends the block (its +1)
            s.accepted_per_block.append(min(n, len(outputs[original]) - checked - 1))
            s.drafted_per_block.append(k)
            s.target_forwards += 1
            s.draft_forwards += k
            if stop is not None or emitted + n + 1 >= max_new_tokens:
                finished.append(r)
        emitted += n + 1
        seq = torch.cat([seq, block], 1)

        # 4. Roll back both caches to seq[:-1]; drop finished rows from the batch.
        for cache in (target_cache, draft_cache):
            excess = cache.get_seq_length() - (seq.shape[1] - 1)
            if excess > 0:
                cache.crop(-excess)
        if finished:
            keep = [r for r in range(len(rows)) if r not in finished]
            if not keep:
                break
            index = torch.tensor(keep, device=device)
            for cache in (target_cache, draft_cache):
                cache.batch_select_indices(index)
            seq, pads = seq[index], pads[index]
            rows = [rows[r] for r in keep]

    sync(device)
    decode_s = time.perf_counter() - start
    results = []
    for original, s in enumerate(stats):
        s.prefill_s, s.decode_s, s.new_tokens = prefill_s, decode_s, len(outputs[original])
        results.append(SpeculativeOutput(torch.tensor(outputs[original], dtype=torch.long, device=device), s))
    return results
