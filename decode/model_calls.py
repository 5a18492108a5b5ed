"""The model calls every decoding loop, benchmark and script shares: one forward over new tokens with a
transformers ``DynamicCache``, the prompt prefill, cache crops, device syncs and the vocabulary size.

Kept apart from the loops so that a loop reads as its algorithm, and so that a profiler (or a test) can
time every forward in one place (``decode.model_calls.forward``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache


def vocab_size_of(model) -> int:
    """The vocabulary size of ``model``'s (text) config: the rows of its output head."""
    return model.config.get_text_config().vocab_size


@functools.lru_cache(maxsize=None)
def forward_parameters(model_class: type) -> frozenset[str]:
    """The argument names of ``model_class.forward`` (transformers versions rename some)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward(model, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
    """One cached forward of ``input_ids`` ``(1, n)`` -> logits ``(n, V)`` (``(1, V)`` if last_only)."""
    parameters = forward_parameters(type(model))
    # transformers 5.x renames `past_key_values` to `cache` (the old name goes in 5.40).
    kwargs = {"cache" if "cache" in parameters else "past_key_values": cache, "use_cache": True}
    if last_only and "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    logits = model(input_ids=input_ids, **kwargs).logits[0]
    return logits[-1:] if last_only else logits


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (no-op if it holds no more)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5.x: negative = tokens to remove; positive raises


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (timings); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, prompt: torch.Tensor) -> DynamicCache:
    """A cache holding all prompt tokens but the last; ``prompt`` is ``(1, L)``."""
    cache = DynamicCache()
    if prompt.shape[1] > 1:
        forward(model, prompt[:, :-1].to(model.device), cache, last_only=True)
    return cache
