"""The head's training-time test over whole sequences: K draft steps at every block start at once.

In the decoder a block starting at entry ``s`` runs the head once on the target's state there (step 1),
then on its own output states (steps 2..K), each step attending to the entries ``0..s`` built from the
target's states and to the block's own earlier steps. Here step j is computed at every ``s`` in one
forward: its query at ``s`` sees the step-1 keys ``0..s`` (causal) and the keys of steps 2..j at ``s``
(the diagonal), at position ``s + j - 1``. This is SpecForge's training-time-test attention (Li et al.
2025, arXiv:2503.01840, Sec. 3.2), here with the decoder's positions. Step j reads the true token
``x[s + j]``: a draft that differs from it ends the greedy block before any later draft counts, so the
block's accepted drafts are exact (``decode.eagle3.simulation``), and training sees the decoder's
inputs along the accepted path.
"""

from __future__ import annotations

import math

import torch

from decode.eagle3.head import Eagle3Head


def _shifted(input_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """``input_ids`` ``(batch, T)`` moved left by ``shift``, padded with token 0 (entries past the end)."""
    pad = input_ids.new_zeros(input_ids.shape[0], shift)
    return torch.cat([input_ids[:, shift:], pad], dim=1)[:, : input_ids.shape[1]]


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  entries: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of step ``len(keys)``: queries ``q`` ``(batch, heads, n, d)`` at ``entries`` (``(n,)`` entry
    indices; None: all T) over the step-1 keys ``(batch, kv_heads, T, d)`` causally and the later steps' keys
    ``(batch, kv_heads, n, d)`` of the same entries (the diagonal). Returns ``(batch, heads, n, d)``."""
    groups = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    first_k, first_v = keys[0].repeat_interleave(groups, 1), values[0].repeat_interleave(groups, 1)
    scores = (q @ first_k.transpose(-1, -2)) * scale
    length = first_k.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if entries is not None:
        causal = causal[entries]
    scores = scores.masked_fill(~causal, float("-inf"))
    diagonal = [(q * k.repeat_interleave(groups, 1)).sum(-1, keepdim=True) * scale for k in keys[1:]]
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    out = weights[..., :length] @ first_v
    for i, v in enumerate(values[1:]):
        out = out + weights[..., length + i: length + i + 1] * v.repeat_interleave(groups, 1)
    return out


def unroll(head: Eagle3Head, embed_tokens, input_ids: torch.Tensor, aux_states: torch.Tensor, steps: int,
           entries: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's outputs for ``steps`` steps at every entry (or at ``entries`` only from step 2 on).

    Args:
        head: the EAGLE-3 head.
        embed_tokens: the target's input embedding (a module: ids -> ``(batch, T, hidden)``).
        input_ids: ``(batch, T)`` the sequence (prompt and answer, right-padded).
        aux_states: ``(batch, T, 3 * hidden)`` the target's aux-layer outputs at each position.
        steps: K >= 1.
        entries: ``(n,)`` ascending entry indices whose drafts are wanted (the simulation's block starts):
            step 1 still runs over all T (its keys are every later step's context), steps 2..K over these
            only. None: all entries (training).

    Returns:
        ``steps`` tensors ``(batch, T or n, hidden)``: element j at entry s is the LM head's input for the
        head's (j+1)-th draft of a block whose first draft follows ``x[s + 1]``, i.e. its prediction of
        ``x[s + j + 2]`` (``head.lm_head`` of it: draft-vocabulary logits; callers apply it where they need it).

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    hidden = head.fuse(aux_states)
    keys, values, outputs = [], [], []
    for j in range(steps):
        with torch.no_grad():  # the target's embedding is frozen: no gradient reaches it
            embeds = embed_tokens(_shifted(input_ids, j + 1))
        if j == 1 and entries is not None:  # from here on only the wanted entries
            hidden, positions = hidden[:, entries], positions[:, entries]
        if j >= 1 and entries is not None:
            embeds = embeds[:, entries]
        step = head.begin_step(embeds, hidden, positions + j)
        keys.append(step.k)
        values.append(step.v)
        normed, hidden = head.end_step(ttt_attention(step.q, keys, values, entries if j else None), step.residual)
        outputs.append(normed[:, entries] if j == 0 and entries is not None else normed)
    return outputs
