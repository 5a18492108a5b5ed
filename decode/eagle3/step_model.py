"""The head's draft step behind the call ``decode.costs`` times: a causal-LM-like forward over a
``DynamicCache``, so that the head's c is measured in the same interleaved rounds as a sibling drafter's.

A decoding step from the second draft on reads one token's embedding and the previous step's state; the
cost does not depend on the state's values, so a zero state stands in for it. The first draft of a block
also takes in the pending target states (one more entry per accepted token); c is the one-entry step, as
for a sibling drafter.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache

from decode.eagle3.head import Eagle3Head


class HeadStepModel(nn.Module):
    """``HeadStepModel(head, embed_tokens)(input_ids (1, n), past_key_values=cache)`` runs ``n`` head entries
    and returns ``.logits`` ``(1, n, V)`` (``(1, 1, V)`` with ``logits_to_keep``) over the target's vocabulary,
    as ``eagle3_generate`` computes a draft."""

    def __init__(self, head: Eagle3Head, embed_tokens: nn.Module):
        super().__init__()
        self.head, self.embed_tokens = head, embed_tokens
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(vocab_size=head.config.vocab_size))

    @property
    def device(self) -> torch.device:
        return self.head.device

    def forward(self, input_ids: torch.Tensor, past_key_values: DynamicCache | None = None, use_cache: bool = True,
                logits_to_keep: int | None = None) -> SimpleNamespace:
        cache = past_key_values if past_key_values is not None else DynamicCache()
        start, count = cache.get_seq_length(), input_ids.shape[1]
        embeds = self.embed_tokens(input_ids)
        state = torch.zeros(1, count, self.head.config.hidden_size, dtype=embeds.dtype, device=embeds.device)
        positions = torch.arange(start, start + count, device=input_ids.device).unsqueeze(0)
        logits, _ = self.head.cached_step(embeds, state, positions, cache)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.head.full_vocab_logits(logits))
