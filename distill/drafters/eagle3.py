"""The EAGLE-3 head a run starts from: its shape from the target, its draft vocabulary from the training
answers, its weights random or from the target's last layer (``drafter.head_init``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.eagle3.head import Eagle3Config, Eagle3Head
from decode.progress import decoder_layers
from distill.errors import ConfigError
from distill.models.reduced_vocab import draft_vocabulary


def initial_head(target, completions: Sequence[Sequence[int]], *, draft_vocab_size: int | None,
                 aux_layers: Sequence[int] | None, head_init: str, always: Sequence[int] = (),
                 seed: int = 0) -> Eagle3Head:
    """A new head for ``target`` (float32, train mode).

    Args:
        target: the target (transformers causal LM).
        completions: the training answers' token ids; the draft vocabulary is their ``draft_vocab_size`` most
            frequent tokens (``distill.models.reduced_vocab.draft_vocabulary``), ``always`` kept (EOS ids).
        draft_vocab_size: N, or None for the target's whole vocabulary.
        aux_layers: target layers fused (None: SpecForge's three).
        head_init: ``target`` (``init_from_target``) or ``random`` (transformers' normal(0, 0.02) init).
        seed: torch's seed for the random weights.

    Raises:
        ConfigError: a draft vocabulary or aux layer the target cannot have.
    """
    vocab = target.config.get_text_config().vocab_size
    try:
        config = Eagle3Config.from_target(target.config, draft_vocab_size, list(aux_layers) if aux_layers else None)
        ids = draft_vocabulary(completions, vocab, draft_vocab_size, always) if draft_vocab_size else None
    except ValueError as err:
        raise ConfigError(f"drafter (EAGLE-3 head): {err}") from err
    torch.manual_seed(seed)
    head = Eagle3Head(config, ids)
    std = getattr(target.config.get_text_config(), "initializer_range", 0.02)
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)
    if head_init == "target":
        init_from_target(head, target)
    return head.float().train()


def check_head_config(cfg) -> None:
    """From the target's config alone (no weights), before any run folder or model load: the head
    ``drafter.aux_layers`` and ``drafter.draft_vocab_size`` ask for fits the target; nothing for other drafters.

    Raises:
        ConfigError: an aux layer the target lacks, aux layers out of order, or a draft vocabulary too large.
    """
    if cfg.drafter.init != "eagle3":
        return
    from transformers import AutoConfig

    from distill.models.loading import resolve_model

    target_config = AutoConfig.from_pretrained(resolve_model(cfg.target.name).path)
    try:
        Eagle3Config.from_target(target_config, cfg.drafter.draft_vocab_size, cfg.drafter.aux_layers)
    except ValueError as err:
        raise ConfigError(f"drafter (EAGLE-3 head): {err}") from err


@torch.no_grad()
def init_from_target(head: Eagle3Head, target) -> None:
    """Start the head from the target's last decoder layer (its attention weights in both halves of the
    ``2 * hidden`` input, halved, so a state and an embedding in step give the layer's own projections; MLP and
    norms as they are; attention biases dropped: vLLM's head has none), the target's final norm and its LM head's
    draft rows; ``fc`` passes the highest aux layer through. What trains better is measured, not assumed
    (docs/eagle3.md)."""
    last = decoder_layers(target)[-1]
    hidden = head.config.hidden_size
    layer = head.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(last.self_attn, name).weight
        getattr(layer.self_attn, name).weight.copy_(torch.cat([weight, weight], dim=1) * 0.5)
    layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
    layer.mlp.load_state_dict(last.mlp.state_dict())
    layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
    layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    head.norm.weight.copy_(target.model.norm.weight)
    rows = head.draft_to_target.to(target.lm_head.weight.device)
    head.lm_head.weight.copy_(target.lm_head.weight.index_select(0, rows))
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:] = torch.eye(hidden)
