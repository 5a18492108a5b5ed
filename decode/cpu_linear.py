"""float32 linear layers through oneDNN on CPUs: cheap multi-token forwards for verification.

Speculative decoding rests on one target forward over K + 1 tokens costing about
as much as a one-token forward: both read every weight once. torch's float32
``nn.Linear`` on CPU goes to MKL's ``sgemm``, whose kernels for a few rows
(2-16 tokens: the verification forward, a batched generate step) run far from
both the memory and the compute bound: on a 2-core AMD EPYC, with torch limited
to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``), an 8960 x 1536 layer took 3.3 ms for one row
and 6.6 ms for four through MKL, 2.0 ms and 2.8 ms through oneDNN with a
prepacked weight; the whole Qwen2.5-Coder-1.5B (float32, 120 cached tokens)
took 424 / 807 / 780 ms for 1 / 4 / 5 tokens through MKL and 326 / 373 / 462 ms
through oneDNN (docs/cpu_linear.md has the commands). MKL picks its kernels by
CPU vendor as well as by instruction set, so on other AMD hosts its few-row
path may be slower still; oneDNN's JIT kernels depend on the instruction set
alone.

:func:`use_onednn_linear` swaps every float32 ``nn.Linear`` of a model for
:class:`OneDNNLinear` (``torch.ops.mkldnn._linear_pointwise`` on a weight
reordered once by ``torch.ops.mkldnn._reorder_linear_weight``, the pair torch's
own inductor emits for CPU linear layers). The result is for inference only
(no autograd), and a row's output does not depend on how many rows share the
call, which keeps greedy verification token-for-token equal to one-token
decoding.
"""

from __future__ import annotations

import torch
from torch import nn

# The row count oneDNN packs the weight for; with it a row's result is the same alone or among up to 16 rows.
_ROWS_HINT = 4


def onednn_linear_available() -> bool:
    """Whether this torch build has the oneDNN CPU linear ops (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Module):
    """Inference-only stand-in for a float32 CPU ``nn.Linear``: ``(..., in_features) -> (..., out_features)``.

    The weight ``(out_features, in_features)`` is held only in oneDNN's packed layout (no second dense
    copy), as a plain attribute: it is not a parameter, not in ``state_dict`` and not moved by ``.to()``;
    ``bias`` ``(out_features,)`` is a buffer. Gradients do not flow through it. A row's result is the same
    alone or among the 2-16 rows of a verification (tested); a long teacher-forced pass may round a little
    differently.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def use_onednn_linear(model: nn.Module) -> int:
    """Swap, in place, every float32 ``nn.Linear`` on the CPU inside ``model`` for :class:`OneDNNLinear`.

    Only for models that are decoded and never trained, exported or saved afterwards. Layers on another
    device, in another dtype, subclasses of ``nn.Linear`` (quantized layers) and a head whose weight is tied
    to the input embedding (a packed copy would double it) are left alone; without oneDNN in the torch build
    nothing changes.

    Returns:
        the number of layers swapped (0 when nothing qualified).
    """
    if not onednn_linear_available():
        return 0
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(embeddings.weight)} if isinstance(embeddings, nn.Embedding) else set()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32 and id(child.weight) not in tied):
                setattr(parent, name, OneDNNLinear(child))
                swapped += 1
    return swapped
