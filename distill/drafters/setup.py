"""The drafter a run starts from, and the checks that refuse a bad drafter before any long work.

Distill builds its drafter here; evaluate and check build the undistilled one the same way, so the
baseline they measure is exactly what training started from.
"""

from __future__ import annotations

from typing import Any

import torch

from distill.config import Config
from distill.drafters.build import LoraSettings, build_drafter
from distill.errors import ConfigError, TokenizerMismatchError
from distill.models.loading import ResolvedModel, load_model, resolve_model, tokenizers_compatible
from distill.parallel import fsdp_refusal

DRAFTER_DIR = "drafter"  # in a distill run: the merged drafter, a save_pretrained folder
DRAFTER_INFO = "drafter_info.json"


def initial_drafter(cfg: Config, dtype: str = "float32", lora: LoraSettings | None = None,
                    quantize_4bit: bool = False):
    """The drafter before distillation, as ``drafter.*`` describes it.

    Args:
        quantize_4bit: load the base in bitsandbytes NF4 with double quantization and bf16
            compute (QLoRA, Dettmers et al. 2023, Sec. 3) and prepare it for k-bit training
            (peft ``prepare_model_for_kbit_training``); needs CUDA (see :func:`check_training_hardware`).

    Returns:
        ``(model, tokenizer, resolved)`` of the drafter's base model.
    """
    extra = {}
    if quantize_4bit:
        from transformers import BitsAndBytesConfig

        extra = {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16), "device_map": {"": torch.cuda.current_device()}}
        dtype = "bfloat16"
    base, tokenizer, resolved = load_model(cfg.drafter.name, dtype=dtype, **extra)
    if quantize_4bit:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    try:
        model = build_drafter(base, init=cfg.drafter.init, num_layers=cfg.drafter.num_layers,
                              layer_selection=cfg.drafter.layer_selection, layers=cfg.drafter.layers, lora=lora)
    except ValueError as err:  # e.g. more layers asked for than the base model has
        raise ConfigError(f"drafter (drafter.*, distill.lora_*): {err}") from err
    return model, tokenizer, resolved


def check_layers_exist(cfg: Config) -> None:
    """Refuse a depth-pruned drafter asking for layers its base model does not have (config only, no weights).

    Raises:
        ConfigError: ``drafter.num_layers`` above, or an index in ``drafter.layers`` at or above, the
            base model's number of decoder layers.
    """
    if cfg.drafter.init != "layers":
        return
    from transformers import AutoConfig

    total = AutoConfig.from_pretrained(resolve_model(cfg.drafter.name).path).num_hidden_layers
    if cfg.drafter.layers is not None and cfg.drafter.layers[-1] >= total:
        raise ConfigError(f"drafter.layers={cfg.drafter.layers}: {cfg.drafter.name} has decoder layers 0..{total - 1}; "
                          "drop the indices above that")
    if cfg.drafter.layers is None and cfg.drafter.num_layers is not None and cfg.drafter.num_layers > total:
        raise ConfigError(f"drafter.num_layers={cfg.drafter.num_layers}: {cfg.drafter.name} has {total} decoder "
                          f"layers; use at most {total}")


def check_training_hardware(cfg: Config) -> None:
    """Refuse fp16 training, ``distill.parallel=fsdp`` and ``distill.method=qlora`` where they cannot run, before
    anything is loaded.

    Raises:
        ConfigError: ``distill.mixed_precision=fp16`` without CUDA; FSDP without CUDA or in a process no launcher
            started (:func:`distill.parallel.fsdp_refusal`); QLoRA without a CUDA device or without
            bitsandbytes, or on a depth-pruned drafter (``drafter.init=layers`` copies layers, which 4-bit
            weights do not allow).
    """
    if cfg.distill.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("distill.mixed_precision=fp16 needs CUDA; on CPU use distill.mixed_precision=auto or no")
    if cfg.distill.parallel == "fsdp" and (why := fsdp_refusal()):
        raise ConfigError(why)
    if cfg.distill.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise ConfigError("distill.method=qlora loads the drafter in bitsandbytes 4-bit, which needs a CUDA GPU; "
                          "on this machine use distill.method=lora (same adapters on an unquantized base)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ConfigError("distill.method=qlora needs bitsandbytes: pip install -e '.[cuda]'") from err
    if cfg.drafter.init != "sibling":
        raise ConfigError("distill.method=qlora needs drafter.init=sibling: a depth-pruned drafter is trained in "
                          "full (distill=full)")


def check_tokenizers(target_tokenizer, drafter_tokenizer, target_name: str, drafter_name: str) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers agree on vocabulary and special tokens."""
    ok, why = tokenizers_compatible(target_tokenizer, drafter_tokenizer)
    if not ok:
        raise TokenizerMismatchError(
            f"target {target_name!r} and drafter {drafter_name!r} have different tokenizers ({why}); "
            "speculative decoding needs one shared vocabulary: pick a drafter from the target's family")


def drafter_info(cfg: Config, target: ResolvedModel, base: ResolvedModel) -> dict[str, Any]:
    """What a tuned drafter must carry so that evaluate and export can check it belongs to the target."""
    return {"target_name": cfg.target.name, "target_fingerprint": target.fingerprint,
            "base_name": cfg.drafter.name, "base_fingerprint": base.fingerprint, "init": cfg.drafter.init,
            "num_layers": cfg.drafter.kept_layers(), "layer_selection": cfg.drafter.layer_selection,
            "layers": cfg.drafter.layers,
            "method": cfg.distill.method, "loss": cfg.distill.loss,
            "target_source": cfg.distill.target_source, "on_policy_fraction": cfg.distill.on_policy_fraction,
            "draft_vocab_size": cfg.drafter.draft_vocab_size}


def check_drafter_tokens(cfg: Config, target_tokenizer) -> None:
    """From tokenizers alone (no weights): the drafter shares the target's tokens and ``drafter.draft_vocab_size``
    fits its vocabulary, so a bad pair is refused before any model loads.

    Raises:
        TokenizerMismatchError: target and drafter cannot share tokens.
        ConfigError: ``drafter.draft_vocab_size`` outside 2..(the drafter's tokens).
    """
    from transformers import AutoTokenizer

    drafter = AutoTokenizer.from_pretrained(resolve_model(cfg.drafter.name).path)
    check_tokenizers(target_tokenizer, drafter, cfg.target.name, cfg.drafter.name)
    size = cfg.drafter.draft_vocab_size
    if size is not None and not 2 <= size <= len(drafter):
        raise ConfigError(f"drafter.draft_vocab_size={size} must be between 2 and the drafter's {len(drafter)} "
                          "tokens (e.g. 32000 for Qwen), or null for the full vocabulary")
