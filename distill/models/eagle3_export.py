"""An EAGLE-3 head in the format vLLM's ``eagle3`` method loads: the ``speculators`` layout (vllm-project/
speculators; vLLM's ``transformers_utils/configs/speculators``), a ``config.json`` and ``model.safetensors``
with the names vLLM's ``llama_eagle3.py`` reads (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``).

``d2t[i]`` is the offset ``target_id - i`` of draft index i (vLLM maps ``i + d2t[i]``); ``t2d`` marks the target
ids in the draft vocabulary. The token embedding is left out: vLLM then shares the target's. vLLM's eagle3
aux-layer ids count hidden states with the embedding as 0, so the outputs of layers ``[1, 13, 24]`` are ids
``[2, 14, 25]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from decode.eagle3.head import Eagle3Head

WEIGHTS = "model.safetensors"


def speculators_config(head: Eagle3Head, target_name: str, draft_length: int) -> dict:
    """``config.json`` of the head in the speculators format (``speculators_model_type: eagle3``)."""
    c = head.config
    layer = c.layer_config().to_dict()
    layer.update({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False})
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual, "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layers],
            "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": draft_length}],
                                   "verifier": {"name_or_path": target_name,
                                                "architectures": ["Qwen2ForCausalLM"]}}}


def export_head(head: Eagle3Head, folder: Path, *, target_name: str, draft_length: int,
                dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Write ``config.json`` and ``model.safetensors`` of ``head`` into ``folder`` (which exists); returns them."""
    tensors = {name: tensor.detach().to(dtype).contiguous().cpu() for name, tensor in head.state_dict().items()
               if name != "draft_to_target"}
    ids = head.draft_to_target.cpu()
    tensors["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(speculators_config(head, target_name, draft_length), indent=2) + "\n")
    return [folder / "config.json", folder / WEIGHTS]
