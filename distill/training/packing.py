"""Sequence packing: a micro-batch's examples laid end to end in dense rows instead of padded ones.

A packed row holds whole examples (one is never split across rows), each with position ids restarting
at 0, and the batch carries no ``attention_mask``: transformers' masking utilities
(``masking_utils.find_packed_sequence_indices``) then read the example boundaries from the position ids
and build a block-diagonal causal mask, so no token attends across examples (sdpa, eager and flex
attention; flash attention only detects packing in a single row, which :func:`check_packing` catches).
Every example sees exactly the tokens and positions it sees padded, so the per-token losses are the same.
The forward must run with ``use_cache=False``: with a cache transformers does not look for packed examples
and the mask is one causal block per row.
"""

from __future__ import annotations

import torch

from decode.packing import pack_rows, packed_positions
from distill.errors import DraftsmithError


def pack_batch(batch: dict[str, torch.Tensor], *, max_seq_len: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch (:func:`distill.training.loop.collate`'s output) repacked into dense rows.

    Args:
        batch: ``input_ids``, ``attention_mask``, ``labels``, ``loss_mask`` (B, T), optionally
            ``top_k_ids`` / ``top_k_logprobs`` (N, k) for the N loss positions in row-major order.
        max_seq_len: tokens per packed row at most (each example already fits: collate cut it).
        pad_token_id: id of the tokens after a row's last example.

    Returns:
        ``input_ids``, ``position_ids`` (int64), ``labels``, ``loss_mask`` (R, L) with R <= B rows and L the
        fullest row's tokens, and the stored top-k rows reordered to the packed row-major order; no
        ``attention_mask``. The padding at a row's end gets positions 0, 1, ... of its own (a block of its
        own, never attended to by an example, never in the loss). ``loss_mask.sum()`` is the batch's.

    Raises:
        ValueError: an example longer than ``max_seq_len``.
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    rows = pack_rows(lengths, max_seq_len)
    positions, places = packed_positions(lengths, rows)
    shape, device = tuple(positions.shape), batch["input_ids"].device
    packed = {"input_ids": torch.full(shape, pad_token_id, dtype=torch.long, device=device),
              "position_ids": positions.to(device),
              "labels": torch.full(shape, pad_token_id, dtype=torch.long, device=device),
              "loss_mask": torch.zeros(shape, dtype=torch.bool, device=device)}
    for i, (r, start) in enumerate(places):
        for key in ("input_ids", "labels", "loss_mask"):
            packed[key][r, start:start + lengths[i]] = batch[key][i, :lengths[i]]
    if "top_k_ids" in batch:
        order = [i for row in rows for i in row]  # the packed row-major order of the examples' loss positions
        counts = batch["loss_mask"].sum(dim=1).tolist()
        for key in ("top_k_ids", "top_k_logprobs"):
            chunks = torch.split(batch[key], counts)
            packed[key] = torch.cat([chunks[i] for i in order])
    return packed


@torch.no_grad()
def check_packing(model: torch.nn.Module, what: str) -> None:
    """Refuse a model whose attention crosses packed examples (its losses would silently change).

    Runs one forward of two packed rows of two short examples each and compares the second example's
    logits with those of the example alone; the model's mode is restored.

    Raises:
        DraftsmithError: the packed logits differ (naming ``what``, e.g. "the drafter").
    """
    device = next(model.parameters()).device
    first, second = [3, 5, 7], [11, 13, 17, 19]
    ids = torch.tensor([first + second] * 2, device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2, device=device)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 3:].float()
        alone = model(input_ids=ids[:, 3:], use_cache=False).logits.float()
    finally:
        model.train(was_training)
    finite = torch.isfinite(alone)  # a reduced-vocabulary head gives -inf outside its tokens
    if not torch.equal(finite, torch.isfinite(packed)):
        raise DraftsmithError(f"distill.packing: {what} gives other non-finite logits packed than alone: use "
                              "distill.packing=false")
    packed, alone = packed[finite], alone[finite]
    scale = float(alone.abs().max()) + 1e-6
    if not torch.allclose(packed, alone, rtol=0.0, atol=2e-2 * scale):
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "?")
        raise DraftsmithError(
            f"distill.packing: {what} (attention {implementation!r}) attends across packed examples (its logits "
            f"differ by up to {float((packed - alone).abs().max()):.3g} from the example alone): use "
            "distill.packing=false")
