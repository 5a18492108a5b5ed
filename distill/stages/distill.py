"""Stage 2: distil the drafter on the target's answers from stage 1.

Reads a finished generate run, builds the drafter (sibling or depth-pruned,
LoRA, QLoRA or full), trains it against the target's next-token distributions (online, or the
top-k log-probabilities generate stored), on the target's answers or, with GKD's mixing, its own
(:func:`distill.training.loop.train_drafter`) and writes the merged drafter in Hugging
Face format to ``<run>/drafter/`` with ``drafter_info.json`` recording the
target it was tuned for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from distill import parallel
from distill.config import Config
from distill.drafters.build import LoraSettings, build_drafter, merge_drafter
from distill.errors import ConfigError, DraftsmithError, TokenizerMismatchError
from distill.stages.generate import load_generated
from distill.hardware import bf16_is_fast, resolve_mixed_precision
from distill.models.loading import ResolvedModel, eos_token_ids, load_model, resolve_model, tokenizers_compatible
from distill.models.reduced_vocab import reduce_for_training, reduce_vocabulary, save_drafter
from distill.training.resume import find_finished, hold_lock, named_checkpoint, prepare_resume, resume_key
from distill.rundir import StageRun, atomic_dir, resolve_input, write_json_atomic
from distill.tracking import NullLogger, make_logger, run_name
from distill.training.loop import train_drafter
from distill.data.training_data import data_identity, resolve_extra_generate, training_examples

log = logging.getLogger(__name__)

DRAFTER_DIR = "drafter"
DRAFTER_INFO = "drafter_info.json"


def initial_drafter(cfg: Config, dtype: str = "float32", lora: LoraSettings | None = None,
                    quantize_4bit: bool = False):
    """The drafter before distillation, as ``drafter.*`` describes it.

    Args:
        quantize_4bit: load the base in bitsandbytes NF4 with double quantization and bf16
            compute (QLoRA, Dettmers et al. 2023, Sec. 3) and prepare it for k-bit training
            (peft ``prepare_model_for_kbit_training``); needs CUDA (see :func:`check_qlora`).

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
    if cfg.drafter.num_layers is not None and cfg.drafter.num_layers > total:
        raise ConfigError(f"drafter.num_layers={cfg.drafter.num_layers}: {cfg.drafter.name} has {total} decoder "
                          f"layers; use at most {total}")


def check_qlora(cfg: Config) -> None:
    """Refuse ``distill.method=qlora`` where it cannot run, before anything is loaded.

    Raises:
        ConfigError: no CUDA device, bitsandbytes missing, or a depth-pruned drafter
            (``drafter.init=layers`` copies layers, which 4-bit weights do not allow).
    """
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
            "num_layers": cfg.drafter.num_layers, "layer_selection": cfg.drafter.layer_selection,
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


def reduce_drafter_vocabulary(cfg: Config, drafter, train_examples, val_examples, eos_ids) -> tuple[Any, Any]:
    """With ``drafter.draft_vocab_size``: reduce the drafter's LM head to the N most frequent tokens of the
    training completions (EAGLE-3, :mod:`distill.models.reduced_vocab`), EOS and pad ids always kept.

    Returns:
        ``(draft_to_target (N,), manifest record with size and coverage)``, or ``(None, None)`` when off.

    Raises:
        ConfigError: N larger than the drafter's vocabulary.
    """
    size = cfg.drafter.draft_vocab_size
    if size is None:
        return None, None
    pad = getattr(drafter.config, "pad_token_id", None)
    always = list(eos_ids) + ([int(pad)] if isinstance(pad, int) else [])
    try:
        return reduce_for_training(drafter, size, [ex["completion_ids"] for ex in train_examples],
                                   [ex["completion_ids"] for ex in val_examples], always=always)
    except ValueError as err:
        raise ConfigError(f"drafter.draft_vocab_size: {err}") from err


def _num_held_out(num_examples: int, val_fraction: float) -> int:
    """Examples the validation split takes (none from a single example: it is needed for training)."""
    return int(num_examples * val_fraction) if num_examples > 1 else 0


def _check_validation_split(d, num_examples: int) -> None:
    """Raises ConfigError: ``distill.validate_every`` is set but the validation split would be empty."""
    if d.validate_every and _num_held_out(num_examples, d.val_fraction) == 0:
        # rounded up to 3 decimals, so the fraction suggested does hold out one example
        fix = (f"raise distill.val_fraction (to at least {math.ceil(1000 / num_examples) / 1000:g})"
               if num_examples > 1 else "generate more prompts (one example cannot be split)")
        raise ConfigError(f"distill.validate_every={d.validate_every} needs held-out examples, but "
                          f"distill.val_fraction={d.val_fraction} of {num_examples} examples holds out none: "
                          f"{fix} or set distill.validate_every=0")


def _state_bytes(model) -> int:
    """Bytes a save_pretrained of ``model`` writes (its parameters and buffers, tied weights once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def run_distill(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run stage 2 into ``run_dir``; returns ``run_dir``, or with ``distill.resume=auto`` the finished run under
    ``outputs`` that already trained the same drafter on the same data and settings for ``max_steps`` (then
    nothing is trained or written).

    Raises:
        IncompleteRunError: no finished generate run to read.
        TokenizerMismatchError: target and drafter cannot share tokens.
        DraftsmithError: the data was generated by another target, or the loss became NaN/inf.
    """
    d = cfg.distill
    if d.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("distill.mixed_precision=fp16 needs CUDA; on CPU use distill.mixed_precision=auto or no")
    mixed_precision = _mixed_precision(d.mixed_precision)
    check_qlora(cfg)
    check_layers_exist(cfg)
    named_checkpoint(d.resume)  # a wrong distill.resume folder is refused before data and models load
    # Several launched processes (distill/parallel.py): all train, only the main one writes the run folder.
    main = parallel.is_main()
    gen_dir = parallel.from_main(lambda: resolve_input(cfg.inputs.generate, cfg.outputs, "generate"))
    dataset, held_out, gen_manifest = load_generated(gen_dir)
    if not cfg.inputs.generate and main:  # the run that also owns the evaluation prompts: say which it is
        print(f"distill: training on {gen_dir}, the newest finished generate run under {cfg.outputs} "
              "(inputs.generate=<run> picks another)")
    extra_dirs = resolve_extra_generate(cfg, gen_dir, gen_manifest)
    stored = d.target_source == "stored"
    if stored and not gen_manifest.get("store_top_k"):
        raise ConfigError(f"distill.target_source=stored needs the target's top-k log-probs, which {gen_dir} does "
                          "not hold: generate again with generate.store_top_k=20 (or use distill.target_source=online)")

    # The examples and their split come before any model loads (the tokenizer is enough), so a split that
    # cannot validate is refused in seconds.
    from transformers import AutoTokenizer

    target_res = resolve_model(cfg.target.name)
    target_tok = AutoTokenizer.from_pretrained(target_res.path)
    if gen_manifest["target"]["fingerprint"] != target_res.fingerprint:  # before a run folder or a model load
        raise DraftsmithError(
            f"{gen_dir} was generated by {gen_manifest['target']['name']!r}, not by target {cfg.target.name!r}: "
            f"set target.name={gen_manifest['target']['name']} or generate data with this target")
    check_drafter_tokens(cfg, target_tok)
    columns = ["prompt_ids", "completion_ids"] + (["top_k_ids", "top_k_logprobs"] if stored else [])
    examples, added = training_examples(dataset, held_out, extra_dirs, target_tok, columns)
    _check_validation_split(d, len(examples))
    random.Random(d.seed).shuffle(examples)
    num_val = _num_held_out(len(examples), d.val_fraction)
    val_examples, train_examples = examples[:num_val], examples[num_val:]
    if not val_examples and d.val_fraction > 0 and main:
        log.warning("distill.val_fraction=%s of %d examples holds out none: no validation figures this run "
                    "(raise distill.val_fraction or generate more prompts)", d.val_fraction, len(examples))
    key = resume_key(cfg, data_identity(gen_manifest, gen_dir, extra_dirs), target_res.fingerprint)
    finished = parallel.from_main(lambda: find_finished(Path(cfg.outputs), key, d.max_steps)) \
        if d.resume == "auto" else None
    if finished is not None:  # training again would reproduce it: hours saved, e.g. when a sweep is re-run
        if main:
            print(f"distill: {finished} already trained this drafter on these data with these settings for "
                  f"{d.max_steps} steps; not training again (distill.resume=never trains anyway)")
        return finished
    inputs = {"generate": str(gen_dir), **({"extra_generate": [str(p) for p in extra_dirs]} if extra_dirs else {})}
    run = StageRun.start("distill", run_dir, config_yaml, inputs=inputs) if main else None

    t0 = time.perf_counter()
    if stored:  # the stored log-probs stand in for the target: only its tokenizer and fingerprint are needed
        target = None
    else:
        target, target_tok, target_res = load_model(target_res, dtype=cfg.target.dtype)
    lora = LoraSettings(r=d.lora_r, alpha=d.lora_alpha, dropout=d.lora_dropout) \
        if d.method in ("lora", "qlora") else None
    drafter, drafter_tok, base_res = initial_drafter(cfg, dtype="float32", lora=lora,
                                                     quantize_4bit=d.method == "qlora")
    if d.method == "full" and d.freeze_embeddings:
        for module in (drafter.get_input_embeddings(), drafter.get_output_embeddings()):
            module.requires_grad_(False)
    check_tokenizers(target_tok, drafter_tok, cfg.target.name, cfg.drafter.name)
    load_s = time.perf_counter() - t0

    draft_ids, draft_vocab = reduce_drafter_vocabulary(cfg, drafter, train_examples, val_examples,
                                                       eos_token_ids(drafter, drafter_tok))

    lock = None

    def claim_run() -> tuple[Path | None, dict]:  # the main process only; the others get its answer
        nonlocal lock
        lock = hold_lock(run_dir)  # released at exit, also when the process is killed
        return prepare_resume(cfg, run_dir, key)

    resume_from, resumed = parallel.from_main(claim_run)
    logger = make_logger(cfg.logger, run_name("distill", run_dir), run_dir, config=dataclasses.asdict(cfg)) \
        if main else NullLogger()
    try:
        metrics = train_drafter(
            drafter, target, train_examples, val_examples=val_examples or None, loss=d.loss,
            jsd_beta=d.jsd_beta, temperature=d.temperature, lr=d.lr, max_steps=d.max_steps,
            batch_size=d.batch_size, grad_accum=d.grad_accum, max_seq_len=d.max_seq_len,
            warmup_steps=d.warmup_steps, weight_decay=d.weight_decay, seed=d.seed,
            output_dir=run_dir / "checkpoints", checkpoint_every=d.checkpoint_every, logger=logger,
            mixed_precision=mixed_precision, resume_from=resume_from,
            on_policy_fraction=d.on_policy_fraction, on_policy_temperature=d.on_policy_temperature,
            eos_token_ids=eos_token_ids(drafter, drafter_tok), keep_checkpoints=d.keep_checkpoints,
            validate_every=d.validate_every, validation_draft_length=cfg.decode.draft_length)
        metrics["mixed_precision"] = mixed_precision  # what "auto" became on this machine
        # k the targets were cut to (the smallest among the runs that added examples)
        metrics["stored_top_k"] = min(r["store_top_k"] for r in [gen_manifest, *added]
                                      if r.get("examples", 1)) if stored else None
        logger.summary({k: v for k, v in metrics.items() if v is not None})
    finally:
        logger.finish()
    parallel.barrier()  # every process has finished training before the main one saves
    return parallel.from_main(lambda: _save_run(cfg, run, drafter, drafter_tok, target_res, base_res, lora,
                                                draft_ids, lock, metrics=metrics, draft_vocab=draft_vocab,
                                                num_train=len(train_examples), num_val=len(val_examples),
                                                load_s=load_s, resumed=resumed, added=added))


def _mixed_precision(setting: str) -> str:
    """``distill.mixed_precision`` resolved for this machine, with a warning for bf16 without bf16 hardware."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # named in the warning
    if setting == "bf16" and not bf16_is_fast() and parallel.is_main():
        log.warning("distill.mixed_precision=bf16: this %s has no bf16 matrix units (CPUs need AVX512-BF16 or AMX), "
                    "so torch runs a scalar fallback and a training step takes many times longer than in float32 "
                    "(~40x for the backward pass on an AVX2 CPU); distill.mixed_precision=auto picks for you",
                    device.upper())
    return resolve_mixed_precision(setting)


def _save_run(cfg: Config, run: StageRun, drafter, drafter_tok, target_res: ResolvedModel, base_res: ResolvedModel,
              lora: LoraSettings | None, draft_ids, lock, *, metrics: dict, draft_vocab, num_train: int,
              num_val: int, load_s: float, resumed: dict, added: list[dict[str, Any]]) -> Path:
    """The main process's end of :func:`run_distill`: the merged drafter, its info, the manifest and COMPLETE."""
    d, run_dir = cfg.distill, run.path
    if d.method == "qlora":
        # merge the adapters into an unquantized copy of the base: a 4-bit merge would round them away
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        adapters = get_peft_model_state_dict(drafter)
        drafter, _, _ = initial_drafter(cfg, dtype="float32", lora=lora)
        set_peft_model_state_dict(drafter, {k: v.float().cpu() for k, v in adapters.items()})
        if draft_ids is not None:  # the LoRA-frozen head: the same rows as the one trained with
            reduce_vocabulary(drafter, draft_ids)
    merged = merge_drafter(drafter)
    info = drafter_info(cfg, target_res, base_res)
    info["training_data"] = {"train_examples": num_train, "val_examples": num_val, "generate_runs": 1 + len(added)}
    final = run_dir / DRAFTER_DIR
    with atomic_dir(final, needed_bytes=_state_bytes(merged)) as tmp:
        save_drafter(merged, tmp)  # the full-vocabulary model (+ draft_vocab.safetensors if reduced)
        drafter_tok.save_pretrained(tmp)
        write_json_atomic(tmp / DRAFTER_INFO, info)
    lock.close()
    return run.complete(artifacts=(DRAFTER_DIR,), drafter=info, num_train_examples=num_train,
                        num_val_examples=num_val, model_load_s=round(load_s, 2), train=metrics,
                        draft_vocab=draft_vocab, **resumed,
                        **({"extra_generate": added} if added else {}))
