"""The target's forward with the hidden states an EAGLE-3 head reads: the outputs of its aux layers.

Read with forward hooks on the decoder layers (the outputs before the final norm, as vLLM's and SpecForge's
heads read them), so no other layer's states are kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from decode.progress import decoder_layers


@contextlib.contextmanager
def aux_states_of(target, aux_layers: Sequence[int]) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each target forward appends the concatenated outputs of ``aux_layers``
    ``(batch, n, len(aux_layers) * hidden)`` to the yielded list.

    Raises:
        ValueError: an aux layer the target does not have.
    """
    layers = decoder_layers(target) or ()
    if any(not 0 <= i < len(layers) for i in aux_layers):
        raise ValueError(f"aux layers {list(aux_layers)} must lie in 0..{len(layers) - 1} (the target's layers)")
    outputs: dict[int, torch.Tensor] = {}
    collected: list[torch.Tensor] = []

    def keep(index):
        def hook(_module, _inputs, output):
            outputs[index] = output[0] if isinstance(output, tuple) else output
            if len(outputs) == len(set(aux_layers)):
                collected.append(torch.cat([outputs[i] for i in aux_layers], dim=-1))
                outputs.clear()
        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in sorted(set(aux_layers))]
    try:
        yield collected
    finally:
        for handle in handles:
            handle.remove()


def teacher_forced_states(target, input_ids: torch.Tensor, aux_layers: Sequence[int],
                          attention_mask: torch.Tensor | None = None,
                          logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached target forward over ``input_ids`` ``(batch, T)`` (right-padded, ``attention_mask``
    ``(batch, T)``) -> logits ``(batch, T, V)`` (the last ``logits_to_keep`` positions only, when > 0: the
    states are what a greedy simulation needs, not a ``(T, 151936)`` head output) and aux states
    ``(batch, T, len(aux_layers) * hidden)``."""
    with aux_states_of(target, aux_layers) as states:
        logits = target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                        logits_to_keep=logits_to_keep).logits
    return logits, states[-1]
