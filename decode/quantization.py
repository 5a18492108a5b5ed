"""Cheaper drafters at decode time: int8 dynamic quantization of the drafter's linear layers.

The drafter's precision never changes the output of speculative decoding (the
target decides every token), only how often its drafts are accepted and how
much each costs. On CPUs int8 dynamic quantization (int8 weights, activations
quantized on the fly, fbgemm/onednn kernels) makes a 1-token drafter forward
about 2.6x cheaper than bf16 (Qwen2.5-Coder-0.5B on 2 EPYC cores, torch 2.13;
figures below). The target is never quantized.

Two choices keep the int8 drafter close to the bf16 one. Activations are quantized
**per token** (:class:`PerTokenDynamicLinear`), not per forward as torch's dynamic
``Linear`` does: Qwen-style models carry a few "massive activations" (Sun et al.
2024, "Massive Activations in Large Language Models") on the first token and some
delimiters, and one scale for a whole multi-token forward (the prompt prefill)
leaves the other tokens of the prompt a few int8 levels. Weights are quantized
**per output channel**, not per tensor. Measured by ``scripts/drafter_quantization.py``
on the shipped 0.5B drafter (teacher-forced top-1 agreement with the 1.5B target's
greedy answers to 22 held-out prompts, 6 of the default evaluation set and 16 unseen
ShareGPT ones, fed as the decoder feeds a drafter; ms per 1-token forward, 2 cores):
bf16 0.830 (48.6 ms); torch's int8 0.795 (18.6 ms); per-token activations alone
0.800; per-channel weights alone 0.811; both 0.823 (18.5 ms). Chat prompts gain the
most (0.756 -> 0.795, bf16 0.803).
"""

from __future__ import annotations

import copy
import warnings

import torch

from decode.cpu_linear import use_onednn_linear

QUANTIZATIONS = ("auto", "none", "int8-dynamic")


class PerTokenDynamicLinear(torch.ao.nn.quantized.dynamic.Linear):
    """torch's dynamic int8 ``Linear`` with one activation scale per token instead of one per call.

    ``linear_dynamic`` quantizes its whole input ``(..., tokens, in_features)`` with a single
    scale. Dividing each token's row by its own max-abs ``s`` first makes that shared scale fit
    every row, and the output row is multiplied back: ``y = s * (W (x / s)) + b``, exact in real
    arithmetic because the layer is linear. A one-token forward (every drafting step) is torch's
    layer unchanged; only multi-token forwards (the prompt, catching up after a block) pay a few
    elementwise ops on the input ``(tokens, in_features)`` and output ``(tokens, out_features)``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._float_bias: torch.Tensor | None = None  # __init__ packs a zero bias (or none)
        # load_state_dict fills the packed parameters without set_weight_bias: refresh after it
        self.register_load_state_dict_post_hook(lambda module, _: module._refresh_bias())

    def _get_name(self) -> str:  # how print(model) names it
        return "PerTokenDynamicQuantizedLinear"

    def _refresh_bias(self) -> None:
        bias = self.bias()
        self._float_bias = None if bias is None else bias.detach().float().clone()

    def set_weight_bias(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        super().set_weight_bias(w, b)
        # from b itself: unpacking the packed weight for it (bias()) costs as much as packing it
        self._float_bias = None if b is None else b.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= 1:  # one token: per-call is per-token already
            return super().forward(x)
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        y = super().forward(x / scale)
        if self._float_bias is None:
            return y * scale
        return torch.addcmul(self._float_bias, y - self._float_bias, scale)


def resolve_quantization(mode: str, device: torch.device) -> str:
    """``auto`` -> ``int8-dynamic`` on CPU, ``none`` elsewhere; other modes unchanged."""
    if mode == "auto":
        return "int8-dynamic" if torch.device(device).type == "cpu" else "none"
    return mode


def quantize_drafter(model, mode: str, *, inplace: bool = False):
    """The drafter to decode with: ``model`` itself (``none``) or an int8-dynamic copy.

    ``auto`` means ``int8-dynamic`` on CPU and ``none`` elsewhere.

    ``int8-dynamic`` copies the model to float32 and replaces every
    ``nn.Linear`` (the LM head included) by :class:`PerTokenDynamicLinear`
    (``torch.ao`` dynamic int8, weights per output channel, activations per
    token); embeddings and norms stay float32. The original
    model is left untouched (it is still needed for export and baselines).

    Args:
        model: a causal LM (transformers ``PreTrainedModel``) on the CPU.
        mode: one of ``QUANTIZATIONS``.

        inplace: quantize ``model`` itself (it is then the int8 model) instead of a copy.

    Returns:
        the model to pass to the decoder (eval mode).

    Raises:
        ValueError: unknown mode, or int8-dynamic on a non-CPU device (the
            kernels are CPU only; use a bf16 drafter on GPUs).
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"unknown drafter quantization {mode!r}: choose one of {', '.join(QUANTIZATIONS)}")
    mode = resolve_quantization(mode, model.device)
    if mode == "none":
        return model
    if model.device.type != "cpu":
        raise ValueError(f"int8-dynamic drafter quantization runs on CPU only (the drafter is on {model.device}); "
                         f"set decode.drafter_quantization=none and use a bf16 drafter on GPUs")
    # in place, a bf16 drafter never exists beside its float32 copy: 0.5B drafters held side by side fit in RAM
    quantized = (model if inplace else copy.deepcopy(model)).float().eval()
    with warnings.catch_warnings():
        # torch 2.13 marks torch.ao.quantization deprecated in favour of torchao; its eager dynamic
        # quantization is still the fastest int8 path on CPU without torch.compile.
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            quantized, {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8,
            mapping={torch.nn.Linear: PerTokenDynamicLinear}, inplace=inplace)


def drafter_for_decoding(model, mode: str, *, inplace: bool = False):
    """The drafter as the decoder runs it: an int8 copy (:func:`quantize_drafter`; ``model`` itself quantized with
    ``inplace``), or ``model`` itself with its float32 CPU linear layers swapped in place for oneDNN ones
    (:func:`decode.cpu_linear.use_onednn_linear`), so pass a model that is only decoded from here on.

    Raises:
        ValueError: as :func:`quantize_drafter`.
    """
    runner = quantize_drafter(model, mode, inplace=inplace)
    if resolve_quantization(mode, model.device) == "none":
        use_onednn_linear(runner)
    return runner
