"""The EAGLE-3 draft head: one decoder layer that drafts from the target's own hidden states.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840, Sec. 3 and Fig. 5), laid out as vLLM's ``llama_eagle3.py`` and
SpecForge's ``llama3_eagle.py`` lay it out, so that the weights load there under the same names:

- ``fc`` (no bias) fuses the target's hidden states of three layers (low, middle, high), concatenated
  ``(..., 3 * hidden)``, into ``g`` ``(..., hidden)``;
- ``midlayer``: the attention reads ``[input_layernorm(embed(token)), hidden_norm(g)]`` ``(..., 2 * hidden)``;
  the residual is ``g`` (raw, or normed with ``norm_before_residual``); then the usual post-attention
  norm, MLP and residual;
- ``norm`` and ``lm_head`` over the draft vocabulary ``(..., N)``; ``draft_to_target`` maps draft index i to
  target id (vLLM's ``d2t`` holds the offsets ``draft_to_target[i] - i``).

Entry ``s`` of the head reads the token ``x[s + 1]`` with the target's state at ``s`` (which predicted
``x[s + 1]``) and predicts ``x[s + 2]``. After the first step the head reads its own output state, before
the final norm, in place of the target's (training-time test). The token embedding is the target's and is
not part of the head.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

CONFIG_FILE = "eagle3_head.json"
WEIGHTS_FILE = "eagle3_head.safetensors"


def default_aux_layers(num_layers: int) -> list[int]:
    """The target layers whose outputs EAGLE-3 fuses: low, middle, high (0-indexed decoder layers).

    SpecForge and vLLM read the inputs of layers ``2, L // 2, L - 3``, i.e. the outputs of layers
    ``1, L // 2 - 1, L - 4`` (for Qwen2.5-1.5B's 28 layers: 1, 13, 24).

    Raises:
        ValueError: fewer than 1 layer.
    """
    if num_layers < 1:
        raise ValueError(f"a target needs at least 1 decoder layer, got {num_layers}")
    # ascending, as vLLM concatenates them (repeats only for targets of fewer than 5 layers)
    return sorted([min(1, num_layers - 1), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)])


@dataclass
class Eagle3Config:
    """The head's shape; the layer's sizes are the target's (vLLM and SpecForge require hidden equal to the
    target's).

    Attributes:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
            rope_theta, max_position_embeddings: the decoder layer's, copied from the target.
        vocab_size: the target's vocabulary (rows of its LM head).
        draft_vocab_size: N, rows of the head's LM head.
        aux_layers: target decoder layers (0-indexed) whose outputs are fused, low to high.
        norm_before_residual: the residual is ``hidden_norm(g)`` instead of ``g`` (a speculators option).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    norm_before_residual: bool = False

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int | None = None, aux_layers: list[int] | None = None,
                    intermediate_size: int | None = None) -> Eagle3Config:
        """The head for a target whose (text) config is ``target_config``.

        Raises:
            ValueError: an aux layer outside the target, or a draft vocabulary larger than the target's.
        """
        text = target_config.get_text_config()
        layers = list(aux_layers) if aux_layers else default_aux_layers(text.num_hidden_layers)
        if layers != sorted(layers):
            raise ValueError(f"aux layers {layers} must be ascending (low, middle, high: the order vLLM concatenates "
                             f"them in); set drafter.aux_layers")
        if any(not 0 <= i < text.num_hidden_layers for i in layers):
            raise ValueError(f"aux layers {layers} must lie in 0..{text.num_hidden_layers - 1} "
                             f"(the target's decoder layers); set drafter.aux_layers")
        vocab = draft_vocab_size or text.vocab_size
        if not 1 <= vocab <= text.vocab_size:
            raise ValueError(f"draft vocabulary {vocab} must be in 1..{text.vocab_size} (the target's vocabulary)")
        rope = getattr(text, "rope_parameters", None) or {}
        return cls(hidden_size=text.hidden_size, intermediate_size=intermediate_size or text.intermediate_size,
                   num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                   vocab_size=text.vocab_size, draft_vocab_size=vocab, aux_layers=layers,
                   rms_norm_eps=text.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)),
                   max_position_embeddings=text.max_position_embeddings)

    def layer_config(self) -> LlamaConfig:
        """The decoder layer's config as a ``LlamaConfig`` (speculators' ``transformer_layer_config``)."""
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, num_hidden_layers=1,
                           max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           hidden_act="silu", mlp_bias=False, attention_bias=False)


class Eagle3Attention(nn.Module):
    """Grouped-query attention over ``2 * hidden`` inputs; the keys it attends to are the caller's."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        width, heads, kv = 2 * config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, config.head_dim
        self.q_proj = nn.Linear(width, heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv * config.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * config.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(batch, n, 2 * hidden)`` -> q ``(batch, heads, n, head_dim)``, k and v
        ``(batch, kv_heads, n, head_dim)``, with rotary positions applied to q and k."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v


class Eagle3Layer(nn.Module):
    """vLLM's ``midlayer``: the decoder layer whose attention reads the token and the fused state."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.layer_config())


@dataclass
class StepInput:
    """One head step's inputs and what its attention keeps.

    Attributes:
        q: ``(batch, heads, n, head_dim)`` queries; k, v: ``(batch, kv_heads, n, head_dim)`` this step's keys.
        residual: ``(batch, n, hidden)`` the layer's residual stream before attention.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (see the module docstring). The attention's keys are chosen by the caller: a cache
    in the decoder (``cached_step``), or the training-time-test layout over a whole sequence
    (``decode.eagle3.unroll``).

    Args:
        config: ``Eagle3Config``.
        draft_to_target: LongTensor ``(N,)`` ascending target ids (None: the whole vocabulary, N = V).

    Raises:
        ValueError: ``draft_to_target``'s length is not ``config.draft_vocab_size``.
    """

    def __init__(self, config: Eagle3Config, draft_to_target: torch.Tensor | None = None):
        super().__init__()
        if draft_to_target is None:
            draft_to_target = torch.arange(config.draft_vocab_size)
        if draft_to_target.numel() != config.draft_vocab_size:
            raise ValueError(f"draft_to_target has {draft_to_target.numel()} ids, the config "
                             f"{config.draft_vocab_size}")
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * config.hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.layer_config())
        self.register_buffer("draft_to_target", draft_to_target.long().clone(), persistent=True)

    # --- the pieces of one step --------------------------------------------------------------------

    def fuse(self, aux_states: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states ``(batch, n, 3 * hidden)`` -> ``g`` ``(batch, n, hidden)``."""
        return self.fc(aux_states.to(self.norm.weight.dtype))  # norms stay float in an int8 head

    def begin_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> StepInput:
        """Token embeddings and states ``(batch, n, hidden)`` at ``positions`` ``(batch, n)`` -> the step's
        queries, keys, values and residual."""
        layer = self.midlayer
        normed_hidden = layer.hidden_norm(hidden)
        residual = normed_hidden if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds.to(hidden.dtype)), normed_hidden], dim=-1)
        cos, sin = self.rotary_emb(x, positions)
        q, k, v = layer.self_attn.project(x, cos, sin)
        return StepInput(q, k, v, residual)

    def end_step(self, attention: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output ``(batch, heads, n, head_dim)`` -> the normed output ``(batch, n, hidden)`` (the
        LM head's input) and the state before the final norm ``(batch, n, hidden)`` that the next step reads."""
        layer = self.midlayer
        batch, _, n, _ = attention.shape
        hidden = residual + layer.self_attn.o_proj(attention.transpose(1, 2).reshape(batch, n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden), hidden

    @property
    def device(self) -> torch.device:
        return self.draft_to_target.device  # a buffer: an int8 layer's weight is a method

    def cached_step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step over ``n`` new entries ``(1, n, hidden)`` that attend to ``cache`` (a transformers
        ``DynamicCache`` of one layer, cropped like a target's) and causally to each other; their keys are
        appended to it. Returns draft logits ``(1, n, N)`` and the states ``(1, n, hidden)``."""
        step = self.begin_step(embeds, hidden, positions)
        keys, values = cache.update(step.k, step.v, 0)
        past = keys.shape[2] - step.q.shape[2]
        mask = torch.ones(step.q.shape[2], keys.shape[2], dtype=torch.bool, device=keys.device).tril(past)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        attention = F.scaled_dot_product_attention(step.q, keys.repeat_interleave(groups, 1),
                                                   values.repeat_interleave(groups, 1), attn_mask=mask)
        normed, hidden = self.end_step(attention, step.residual)
        return self.lm_head(normed), hidden

    def full_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``(..., N)`` -> ``(..., V)`` over the target's vocabulary, ``-inf`` outside the draft
        vocabulary (its tokens have draft probability exactly 0: lossless, see
        ``distill.models.reduced_vocab``)."""
        if self.config.draft_vocab_size == self.config.vocab_size:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_to_target, draft_logits)

    # --- files ---------------------------------------------------------------------------------------

    def save(self, folder: str | Path) -> None:
        """``eagle3_head.json`` and ``eagle3_head.safetensors`` into ``folder`` (created)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=2) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})

    save_pretrained = save  # the name distill's checkpoints call

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
        """The head saved in ``folder`` by ``save``, in eval mode.

        Raises:
            FileNotFoundError: ``folder`` holds no head.
        """
        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{folder} holds no EAGLE-3 head ({CONFIG_FILE} missing)")
        config = Eagle3Config(**json.loads((folder / CONFIG_FILE).read_text()))
        tensors = load_file(str(folder / WEIGHTS_FILE))
        head = cls(config, tensors["draft_to_target"])
        head.load_state_dict(tensors)
        return head.to(dtype).eval()


def is_eagle3_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a saved EAGLE-3 head."""
    return (Path(path) / CONFIG_FILE).is_file()
