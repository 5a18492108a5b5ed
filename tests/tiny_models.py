"""The one factory of tiny random Qwen2 models for unit tests (the CLI's tiny models are distill.models.tiny)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(num_layers: int, seed: int = 0, *, vocab_size: int, head_scale: float = 1.0,
               **config: Any) -> Qwen2ForCausalLM:
    """A random Qwen2 (hidden 64, 4 query / 2 key-value heads, MLP 128) in eval mode, seeded by ``seed``.

    ``head_scale`` multiplies the LM head's weights (larger = more peaked next-token distributions);
    ``config`` overrides any other ``Qwen2Config`` field (``initializer_range``, ``tie_word_embeddings``,
    ``pad_token_id``, ``eos_token_id``, ...). The same arguments give the same weights.
    """
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(Qwen2Config(**{**settings, **config})).eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model
