"""Typed configuration for every stage, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` are merged on top of :class:`Config`, so a
misspelled key fails at compose time ("Key 'lrr' is not in struct"), and
:func:`to_config` turns the merged tree into these dataclasses, whose
``__post_init__`` checks ranges and raises :class:`~distill.errors.ConfigError`
naming the key to change. Each field's ``metadata["help"]`` says what it sets:
``draftsmith <stage> --help`` prints it beside the key (:func:`annotated_yaml`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from distill.errors import ConfigError

_ROOT_CONF = Path(__file__).resolve().parent.parent / "conf"
CONF_DIR = _ROOT_CONF if _ROOT_CONF.is_dir() else Path(__file__).resolve().parent / "conf"  # the YAML groups

STAGES = ("generate", "distill", "evaluate", "export", "pipeline", "check", "gather")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOSSES = ("fkl", "rkl", "jsd", "tvd", "ce")
ANSWER_SOURCES = ("auto", "target", "dataset")  # generate.answers: who writes the training answers
PROMPT_SOURCES = ("humaneval", "mtbench", "sharegpt", "file")  # a Prompt's source (data.train_sources)
GENERATE_ENGINES = ("auto", "hf", "vllm")  # generate.engine: what runs the target when it writes answers


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass
class TargetConfig:
    """The target model: the large model whose output must not change."""

    name: str = field(default="qwen2.5-coder-1.5b-instruct", metadata={
        "help": "shipped name, HF folder, .gguf file or hub id"})
    dtype: str = field(default="auto", metadata={
        "help": "auto | float32 | bfloat16 | float16, to generate data, score it and decode; auto = bfloat16 where "
                "the hardware has bf16 matrix units (CUDA Ampere+, CPUs with AVX512-BF16/AMX), else float32 "
                "(distill.hardware.resolve_auto)"})

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "target.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


@dataclass
class DrafterConfig:
    """The draft model before distillation, and how it is cut from its base."""

    name: str = field(default="qwen2.5-coder-0.5b-instruct", metadata={
        "help": "base model the drafter starts from (as target.name)"})
    init: str = field(default="sibling", metadata={
        "help": "sibling: the whole base model; layers: a depth-pruned copy of it; eagle3: an EAGLE-3 head on the "
                "target's own hidden states (drafter=eagle3; drafter.name is not used)"})
    num_layers: Optional[int] = field(default=None, metadata={"help": "with init=layers: decoder layers kept"})
    layer_selection: str = field(default="first", metadata={
        "help": "with init=layers: first N, or N evenly spaced (first | even)"})
    layers: Optional[list[int]] = field(default=None, metadata={
        "help": "with init=layers: explicit decoder layer indices to keep, ascending (e.g. [0,1,2,15,...,23]); "
                "overrides num_layers and layer_selection. Keeping the first few and the last layers starts far "
                "better than either"})
    dtype: str = field(default="auto", metadata={
        "help": "dtype when decoding (training runs in float32); auto as target.dtype"})
    draft_vocab_size: Optional[int] = field(default=None, metadata={
        "help": "EAGLE-3-style reduced vocabulary: the drafter's LM head predicts only the N most frequent tokens of "
                "the training completions (e.g. 32000); null = the full vocabulary. Decoding stays lossless"})
    aux_layers: Optional[list[int]] = field(default=None, metadata={
        "help": "with init=eagle3: the target's decoder layers (0-indexed) whose outputs the head fuses, low to high; "
                "null = SpecForge's [1, L/2 - 1, L - 4] (1, 13, 24 for a 28-layer target)"})
    head_init: str = field(default="target", metadata={
        "help": "with init=eagle3: where the head's layer starts: target (the target's last decoder layer, final "
                "norm and LM head rows) | random"})

    def __post_init__(self) -> None:
        _check(self.init in ("sibling", "layers", "eagle3"), "drafter.init",
               f"must be 'sibling', 'layers' or 'eagle3', got {self.init!r}")
        _check(self.head_init in ("target", "random"), "drafter.head_init",
               f"must be 'target' or 'random', got {self.head_init!r}")
        _check(self.aux_layers is None or self.init == "eagle3", "drafter.aux_layers",
               "applies to drafter.init=eagle3 only (drafter=eagle3)")
        _check(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "drafter.draft_vocab_size",
               f"must be >= 1 (e.g. 32000), or null for the full vocabulary; got {self.draft_vocab_size}")
        _check(self.layer_selection in ("first", "even"), "drafter.layer_selection", "must be 'first' or 'even'")
        if self.layers is not None:
            _check(self.init == "layers", "drafter.layers",
                   "applies to drafter.init=layers only: add drafter.init=layers (or drafter=pruned)")
            keep = list(self.layers)
            _check(len(keep) >= 1 and all(isinstance(i, int) and i >= 0 for i in keep), "drafter.layers",
                   f"must be a non-empty list of layer indices >= 0, e.g. [0,1,2,21,22,23]; got {keep}")
            _check(keep == sorted(set(keep)), "drafter.layers",
                   f"must be ascending without repeats (layers run in the base model's order); got {keep}")
        if self.init == "layers":
            _check(self.layers is not None or (self.num_layers is not None and self.num_layers >= 1),
                   "drafter.num_layers", "must be >= 1 when drafter.init=layers (or give drafter.layers)")
        else:
            _check(self.num_layers is None, "drafter.num_layers",
                   "applies to drafter.init=layers only: add drafter.num_layers=null, or drafter.init=layers")
        _check(self.dtype in DTYPES, "drafter.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")

    def kept_layers(self) -> int | None:
        """How many decoder layers a depth-pruned drafter keeps: ``len(layers)`` when given (they override
        ``num_layers``), else ``num_layers``; None for a whole sibling."""
        return len(self.layers) if self.layers is not None else self.num_layers


@dataclass
class DataConfig:
    """Where prompts come from. Evaluation prompts are held out from training prompts."""

    source: str = field(default="mixed", metadata={"help": "humaneval | mtbench | sharegpt | mixed | file"})
    path: Optional[str] = field(default=None, metadata={
        "help": 'with source=file: a .jsonl ({"prompt": ...} or {"messages": [...]}) or .txt file'})
    seed: int = field(default=0, metadata={
        "help": "seed of the train/held-out prompt split (and of generate's sampling)"})
    on_bad_line: str = field(default="error", metadata={
        "help": "a malformed line of data.path: error (all listed) | skip (warned, counted)"})
    max_prompt_tokens: Optional[int] = field(default=None, metadata={
        "help": "prompts longer than this many tokens (chat template included) are passed over; null = no limit. A "
                "long prompt pads its whole generate batch to its length (a 4,119-token ShareGPT prompt stalled a "
                "batch of 8 for minutes)"})
    train_sources: Optional[list[str]] = field(default=None, metadata={
        "help": "draw the training prompts only from these sources (humaneval, mtbench, sharegpt, file), e.g. "
                "[sharegpt] for the prompts that come with an answer to score; the held-out prompts still come "
                "from every source; null = every source"})
    max_train_prompt_tokens: Optional[int] = field(default=None, metadata={
        "help": "training prompts longer than this many tokens are passed over (held-out ones keep "
                "data.max_prompt_tokens): a long prompt costs the target a forward over every token for few "
                "answer tokens, and distill.max_seq_len cuts it anyway; null = data.max_prompt_tokens alone"})
    mixed_sharegpt: int = field(default=1000, metadata={
        "help": "with source=mixed: how many ShareGPT first turns join HumanEval's 164 and MT-Bench's 80 (the first "
                "of the file); raise it for a larger prompt set (the held-out split is drawn from all of them, so it changes "
                "too)"})

    def __post_init__(self) -> None:
        _check(self.mixed_sharegpt >= 0, "data.mixed_sharegpt", f"must be >= 0, got {self.mixed_sharegpt}")
        _check(self.on_bad_line in ("error", "skip"), "data.on_bad_line", "must be error or skip")
        _check(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "data.max_prompt_tokens",
               f"must be >= 1 (e.g. 512), or null for no limit; got {self.max_prompt_tokens}")
        _check(self.max_train_prompt_tokens is None or self.max_train_prompt_tokens >= 1,
               "data.max_train_prompt_tokens", f"must be >= 1 (e.g. 256), or null; got {self.max_train_prompt_tokens}")
        _check(self.train_sources is None or (len(self.train_sources) > 0
                                              and all(t in PROMPT_SOURCES for t in self.train_sources)),
               "data.train_sources", f"must be null or a non-empty list of {', '.join(PROMPT_SOURCES)}; got "
                                     f"{self.train_sources}")
        sources = ("humaneval", "mtbench", "sharegpt", "mixed", "file")
        _check(self.source in sources, "data.source", f"must be one of {sources}, got {self.source!r}")
        _check(self.source != "file" or bool(self.path), "data.path", "set data.path=<file> with data=file")


@dataclass
class GenerateConfig:
    """Stage 1: the target answers training prompts."""

    num_prompts: int = field(default=32, metadata={
        "help": "training prompts answered (the target also answers the evaluate.num_prompts held-out ones)"})
    answers: str = field(default="auto", metadata={
        "help": "target: the target writes each training answer (generation); dataset: the target scores the answer "
                "that comes with each prompt (ShareGPT's reply, a file's \"answer\" or closing assistant turn) in "
                "one teacher-forced forward per batch, no generation; answers longer than max_new_tokens are cut "
                "there; auto: dataset when every training prompt comes with an answer, else target (the run says "
                "which, and its manifest records it)"})
    engine: str = field(default="auto", metadata={
        "help": "what runs the target when it writes answers: hf (transformers' generate, batches by length) | vllm "
                "(continuous batching; installed as docs/runs.md says) | auto (vllm where installed, on a CUDA GPU or for 128 "
                "training prompts or more; else hf: on a CPU vLLM takes minutes to start)"})
    max_new_tokens: int = field(default=96, metadata={"help": "answer tokens per prompt, at most"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature of the answers; 0 = greedy"})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus sampling: only the most likely tokens up to this probability (1 = all)"})
    batch_size: int = field(default=8, metadata={
        "help": "prompts answered together, at most (with engine=vllm: sequences decoded together)"})
    batch_tokens: int = field(default=6144, metadata={
        "help": "padded prompt tokens a batch holds at most (rows x longest prompt): prompts of a shard are batched "
                "by length, and a long prompt gets a smaller batch instead of padding seven short ones"})
    shard_size: int = field(default=16, metadata={"help": "prompts per shard written to disk (the unit of resume)"})
    store_top_k: int = field(default=20, metadata={
        "help": "keep the target's k most likely tokens + log-probs per answer token, so distill can run without the "
                "target (distill.target_source=stored); 0 = off. ~16 bytes x k per token on disk"})

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "generate.num_prompts", "must be >= 1")
        _check(self.answers in ANSWER_SOURCES, "generate.answers", f"must be one of {', '.join(ANSWER_SOURCES)}")
        _check(self.engine in GENERATE_ENGINES, "generate.engine", f"must be one of {', '.join(GENERATE_ENGINES)}")
        _check(self.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
        _check(self.temperature >= 0, "generate.temperature", "must be >= 0 (0 = greedy)")
        _check(0 < self.top_p <= 1, "generate.top_p", "must be in (0, 1]")
        _check(self.batch_size >= 1, "generate.batch_size", "must be >= 1")
        _check(self.batch_tokens >= 1, "generate.batch_tokens", "must be >= 1 (e.g. 6144)")
        _check(self.shard_size >= 1, "generate.shard_size", "must be >= 1")
        _check(0 <= self.store_top_k <= 1000, "generate.store_top_k", "must be in 0..1000 (0 = off; 20 is plenty)")


@dataclass
class DistillConfig:
    """Stage 2: the drafter learns the target's next-token distributions."""

    loss: str = field(default="fkl", metadata={
        "help": "fkl (forward KL) | rkl (reverse KL) | jsd (generalized JSD, jsd_beta) | tvd (total variation) | ce "
                "(cross-entropy on the target's tokens)"})
    target_source: str = field(default="stored", metadata={
        "help": "online: the target scores every batch (no gradient); stored: use the top-k log-probs that "
                "generate.store_top_k kept (no target in memory, ~2x faster steps; divergences on k+1 buckets)"})
    on_policy_fraction: float = field(default=0.0, metadata={
        "help": "GKD's lambda: share of batches the drafter answers itself (sampled) for the target to score"})
    on_policy_temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature of the drafter's own answers"})
    jsd_beta: float = field(default=0.5, metadata={
        "help": "generalized JSD weight: 0 = forward KL, 1 = reverse KL (GKD)"})
    temperature: float = field(default=1.0, metadata={"help": "softmax temperature of both distributions in the loss"})
    method: str = field(default="lora", metadata={
        "help": "lora | full | qlora (LoRA on a bitsandbytes 4-bit base; CUDA only)"})
    freeze_embeddings: bool = field(default=True, metadata={
        "help": "with method=full: keep the input embeddings and LM head frozen (they are the target family's own, 2 "
                "x 136M parameters in a Qwen 0.5B drafter) and train the decoder layers and final norm only"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (on the attention and MLP projections)"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha: the update is scaled by lora_alpha / lora_r"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA branch's input"})
    lr: float = field(default=2e-4, metadata={
        "help": "peak learning rate (AdamW): linear warmup to it, then distill.lr_schedule"})
    lr_schedule: str = field(default="linear", metadata={
        "help": "after the warmup: linear (decay to 0 at max_steps) | constant (the peak lr to the end: every "
                "checkpoint of one run is a training budget of its own, see distill.checkpoint_at)"})
    max_steps: int = field(default=20, metadata={"help": "optimizer steps in all (a resumed run's included)"})
    batch_size: int = field(default=4, metadata={"help": "examples per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear warmup"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW's decoupled weight decay (none on biases and norms)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute each decoder layer's activations in the backward pass instead of keeping them: activation "
                "memory falls from one copy per layer to about one layer's, for about one more forward of compute "
                "per step (longer sequences or larger batches on a small GPU)"})
    packing: Optional[bool] = field(default=None, metadata={
        "help": "lay each micro-batch's examples end to end in rows of up to max_seq_len tokens (an example never "
                "split; position ids restart per example, so transformers' block-diagonal causal mask keeps them "
                "apart) instead of padding each to the micro-batch's longest: the same loss with fewer pad tokens. "
                "null (default) = packed where the models allow it (checked at start; padded, with a warning, for a "
                "model whose attention would cross examples); true = packed or refused; false = padded. "
                "On-policy answers are generated padded (their loss step is packed), validation stays padded"})
    max_seq_len: int = field(default=512, metadata={
        "help": "prompt + answer tokens per example; longer ones are cut (the prompt from the left, the answer from "
                "the right)"})
    mixed_precision: str = field(default="auto", metadata={
        "help": "auto | no | bf16 | fp16: autocast for the drafter's forward (weights stay fp32). auto = bf16 where "
                "the hardware has bf16 matrix units (CUDA Ampere+, CPUs with AVX512-BF16/AMX), else no: without them "
                "bf16 runs a scalar fallback, ~40x slower backward on an AVX2 CPU"})
    parallel: str = field(default="ddp", metadata={
        "help": "ddp | fsdp: how launched processes (torchrun / accelerate launch) share the training. ddp: each holds "
                "the whole drafter and its AdamW state, gradients are averaged (also one process, and CPUs over gloo). "
                "fsdp: accelerate's FSDP2 shards weights, gradients and AdamW state over the processes (each decoder "
                "layer gathered only while it runs), for a full fine-tune too big for one GPU; CUDA under a launcher "
                "only (on CPU accelerate would silently run DDP, so it is refused), no on-policy data, no qlora. "
                "Checkpoints and the saved drafter are the full model either way; a checkpoint resumes only under "
                "the distill.parallel that wrote it"})
    val_fraction: float = field(default=0.1, metadata={
        "help": "share of generated examples held out for the validation metric"})
    validate_every: int = field(default=0, metadata={
        "help": "also validate every N optimizer steps (0 = before and after only): checkpoints/validation.jsonl + "
                "logger"})
    checkpoint_every: int = field(default=10, metadata={
        "help": "optimizer steps between checkpoints (0 = only at the end)"})
    checkpoint_at: list[int] = field(default_factory=list, metadata={
        "help": "optimizer steps that also write a checkpoint, never pruned (the budget points of one run: "
                "evaluate.checkpoints measures each), e.g. [13,26,40,65]"})
    keep_checkpoints: int = field(default=2, metadata={
        "help": "newest checkpoints kept on disk (0 = all): a full 0.5B checkpoint with optimizer state is ~6 GB"})
    resume: str = field(default="auto", metadata={
        "help": "auto: continue the newest unfinished run of the same data and settings from its last checkpoint "
                "(run the same command again after a crash); never: start fresh; or a checkpoint-<step> folder"})
    seed: int = field(default=0, metadata={
        "help": "seed of the data order and, in a fresh run, of torch's random numbers (LoRA dropout)"})
    ttt_steps: int = field(default=3, metadata={
        "help": "EAGLE-3 head (drafter=eagle3): draft steps trained ahead on the head's own states (training-time "
                "test; SpecForge uses 7), step j's loss weighted 0.8^j"})

    def __post_init__(self) -> None:
        _check(self.loss in LOSSES, "distill.loss", f"must be one of {LOSSES}, got {self.loss!r}")
        _check(1 <= self.ttt_steps <= 16, "distill.ttt_steps", "must be in 1..16 (e.g. 3)")
        _check(0.0 <= self.jsd_beta <= 1.0, "distill.jsd_beta", "must be in [0, 1]")
        _check(self.temperature > 0, "distill.temperature", "must be > 0")
        _check(self.method in ("lora", "full", "qlora"), "distill.method", "must be 'lora', 'full' or 'qlora'")
        _check(self.target_source in ("online", "stored"), "distill.target_source", "must be 'online' or 'stored'")
        _check(0.0 <= self.on_policy_fraction <= 1.0, "distill.on_policy_fraction", "must be in [0, 1] (GKD's lambda)")
        _check(self.on_policy_temperature > 0, "distill.on_policy_temperature", "must be > 0")
        _check(not (self.on_policy_fraction > 0 and self.target_source == "stored"), "distill.on_policy_fraction",
               "on-policy answers are scored by the target online: set distill.target_source=online")
        _check(not (self.on_policy_fraction > 0 and self.loss == "ce"), "distill.loss",
               "ce learns the target's tokens, on-policy answers are the drafter's: use fkl, rkl, jsd or tvd")
        _check(not (self.target_source == "stored" and self.temperature != 1.0), "distill.temperature",
               "stored target log-probs are at temperature 1: keep distill.temperature=1 with target_source=stored")
        _check(self.lora_r >= 1, "distill.lora_r", "LoRA rank must be >= 1")
        _check(self.lora_alpha > 0, "distill.lora_alpha", "LoRA alpha must be > 0")
        _check(0.0 <= self.lora_dropout < 1.0, "distill.lora_dropout", "must be in [0, 1)")
        _check(self.lr > 0, "distill.lr", "must be > 0")
        _check(self.max_steps >= 1, "distill.max_steps", "must be >= 1")
        _check(self.batch_size >= 1, "distill.batch_size", "must be >= 1")
        _check(self.grad_accum >= 1, "distill.grad_accum", "must be >= 1")
        _check(self.mixed_precision in ("auto", "no", "bf16", "fp16"), "distill.mixed_precision",
               "must be auto, no, bf16 or fp16")
        _check(self.parallel in ("ddp", "fsdp"), "distill.parallel", f"must be ddp or fsdp, got {self.parallel!r}")
        # each process generates its own answers, a different number of forwards on each: FSDP's per-layer
        # gathers need every process in the same forward
        _check(not (self.parallel == "fsdp" and self.on_policy_fraction > 0), "distill.on_policy_fraction",
               "on-policy answers cannot be generated under distill.parallel=fsdp: set distill.on_policy_fraction=0 "
               "or distill.parallel=ddp")
        _check(not (self.parallel == "fsdp" and self.method == "qlora"), "distill.method",
               "distill.parallel=fsdp does not shard qlora's 4-bit base: use distill.method=lora or full, or "
               "distill.parallel=ddp")
        _check(self.max_seq_len >= 8, "distill.max_seq_len", "must be >= 8")
        _check(0.0 <= self.val_fraction < 1.0, "distill.val_fraction", "must be in [0, 1)")
        _check(self.checkpoint_every >= 0, "distill.checkpoint_every", "must be >= 0")
        _check(self.lr_schedule in ("linear", "constant"), "distill.lr_schedule",
               f"must be linear or constant, got {self.lr_schedule!r}")
        _check(all(isinstance(s, int) and 1 <= s <= self.max_steps for s in self.checkpoint_at),
               "distill.checkpoint_at", f"must be optimizer steps from 1 to distill.max_steps={self.max_steps}; "
               f"got {list(self.checkpoint_at)}")
        _check(self.keep_checkpoints >= 0, "distill.keep_checkpoints", "must be >= 0 (0 = keep all)")
        _check(self.validate_every >= 0, "distill.validate_every", "must be >= 0 (0 = before and after only)")


@dataclass
class DecodeConfig:
    """The bundled speculative decoder's settings, used by evaluate."""

    draft_length: int = field(default=3, metadata={"help": "K (gamma): draft tokens proposed per target forward"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "sample from the k most likely tokens only; 0 = off"})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus sampling: only the most likely tokens up to this probability (1 = all)"})
    max_new_tokens: int = field(default=64, metadata={"help": "tokens decoded per prompt, at most"})
    schedule: str = field(default="constant", metadata={
        "help": "constant: K every block; heuristic: transformers' rule (K+2 after a fully accepted block, else "
                "K-1); auto: K chosen from a short calibration (per-position acceptance, c, verification cost)"})
    max_draft_length: Optional[int] = field(default=None, metadata={
        "help": "heuristic: cap on K (null = none); auto: calibration K (null = 8)"})
    confidence_threshold: float = field(default=0.0, metadata={
        "help": "stop a draft block below this drafter probability (0 = off)"})
    stop_strings: list[str] = field(default_factory=list, metadata={
        "help": "stop after the token completing one of these"})
    drafter_quantization: str = field(default="auto", metadata={
        "help": "auto | none | int8-dynamic: the drafter as the decoder runs it; auto = int8-dynamic on CPU (about "
                "3x cheaper forwards), none on GPU. Never changes the output, only the cost ratio c and (slightly) "
                "acceptance"})

    def __post_init__(self) -> None:
        _check(self.draft_length >= 1, "decode.draft_length", "must be >= 1")
        # a block never drafts more than the tokens left to emit: a larger K only costs (HF assisted, calibration)
        _check(self.draft_length <= max(self.max_new_tokens, 1), "decode.draft_length",
               f"must be at most decode.max_new_tokens={self.max_new_tokens} (a block drafts no more than the "
               f"tokens left to emit), got {self.draft_length}")
        _check(self.max_draft_length is None or self.max_draft_length <= max(self.max_new_tokens, 1),
               "decode.max_draft_length", f"must be at most decode.max_new_tokens={self.max_new_tokens}, "
               f"got {self.max_draft_length}")
        _check(self.schedule in ("constant", "heuristic", "auto"), "decode.schedule",
               f"must be constant, heuristic or auto, got {self.schedule!r}")
        _check(self.max_draft_length is None or self.max_draft_length >= self.draft_length,
               "decode.max_draft_length", f"must be null or >= decode.draft_length ({self.draft_length})")
        _check(0 <= self.confidence_threshold < 1, "decode.confidence_threshold", "must be in [0, 1) (0 = off)")
        _check(self.drafter_quantization in ("auto", "none", "int8-dynamic"), "decode.drafter_quantization",
               f"must be auto, none or int8-dynamic, got {self.drafter_quantization!r}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "decode.stop_strings",
               "must be a list of non-empty strings")
        _check(self.temperature >= 0, "decode.temperature", "must be >= 0 (0 = greedy)")
        _check(self.top_k >= 0, "decode.top_k", "must be >= 0 (0 = off)")
        _check(0 < self.top_p <= 1, "decode.top_p", "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, "decode.max_new_tokens", "must be >= 1")


@dataclass
class EvaluateConfig:
    """Stage 3: measure the drafter before and after distillation on held-out prompts."""

    num_prompts: int = field(default=64, metadata={
        "help": "held-out evaluation prompts (never used for training): the target answers all of them once "
                "(batched) and every drafter's acceptance and tau on them are simulated exactly from one "
                "teacher-forced pass"})
    timed_prompts: int = field(default=6, metadata={
        "help": "the first (at most num_prompts) also decoded in real time: tokens/s, c, verify costs"})
    prompt_lookup: bool = field(default=True, metadata={
        "help": "also simulate prompt-lookup drafting (no model), the free baseline"})
    prompts: Optional[str] = field(default=None, metadata={
        "help": "a prompt file (the format data=file reads) to evaluate on instead of the generate run's held-out "
                "prompts: its first num_prompts; prompts that were in the distill run's training data are counted in "
                "the report"})
    hf_assisted: bool = field(default=True, metadata={
        "help": "also time transformers' assisted generation with the tuned drafter"})
    timed_drafters: str = field(default="distilled", metadata={
        "help": "which drafters the decoder also times on the timed prompts: distilled (the others' speedups are "
                "predicted from their exact simulated tau and their c timed side by side, at the distilled drafter's K "
                "under decode.schedule=auto) or all (every drafter decoded in real time too, about 40 s each for the "
                "default pair on a 2-core CPU)"})
    draft_length: str = field(default="recommended", metadata={
        "help": "the K the timed runs decode at: recommended = the distilled drafter's K of highest predicted speedup "
                "(its exact simulated tau at K = 1..16 on every evaluation prompt, c timed side by side and the "
                "target's verification costs timed first; decode.schedule=constant only), which every drafter is "
                "then simulated at; decode = decode.draft_length"})
    baseline: bool = field(default=True, metadata={"help": "also measure the undistilled drafter"})
    compare_drafters: list[str] = field(default_factory=list, metadata={
        "help": "other drafters measured untrained in the same run, on the same prompts (shipped names or model "
                'folders), e.g. "[qwen2.5-coder-0.5b-instruct]" to check a depth-pruned drafter against the whole '
                "sibling"})
    compare_vocab_sizes: list[int] = field(default_factory=list, metadata={
        "help": "also measure the stock drafter (drafter.name as shipped) with its LM head cut to the N most frequent "
                "tokens of the training answers, untrained, for each N listed (e.g. [32000,64000]): what a reduced "
                "vocabulary costs in acceptance and saves in c before any distillation"})
    checkpoints: bool = field(default=False, metadata={
        "help": "also measure every checkpoint-<step> the distill run kept (distill.checkpoint_at's budget points; "
                "distill.keep_checkpoints=0 keeps all), untimed, with the distilled drafter's c (the same shapes): "
                "acceptance and tau against training tokens, in report.json budget_curve, a table in report.md and "
                "budget_curve.png"})
    stock_drafter: bool = field(default=True, metadata={
        "help": "when the drafter is depth-pruned or has a reduced vocabulary, also measure drafter.name as shipped "
                "(whole, full vocabulary: what a user has without draftsmith); every drafter's against_stock figures "
                "(paired tau difference and predicted-speedup ratio) are taken against it"})
    target_engine: str = field(default="hf", metadata={
        "help": "target-alone baseline: hf = transformers generate, loop = our KV-cached loop"})
    engines: list[str] = field(default_factory=list, metadata={
        "help": "serving engines also measured on the timed prompts with the distilled and the stock drafter, "
                "after the torch measurements: vllm (speculative method draft_model), llama_cpp; each speedup "
                "measured and predicted from the exact tau and the engine's own costs (report.json engines)"})
    llama_cpp_bin: Optional[str] = field(default=None, metadata={
        "help": "folder of llama.cpp's llama-completion, llama-speculative-simple and llama-bench (null: "
                "$LLAMA_CPP_BIN, then PATH)"})
    seed: int = field(default=0, metadata={
        "help": "seed of sampled decoding, the simulations and the bootstrap intervals"})

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "evaluate.num_prompts", "must be >= 1")
        _check(self.timed_prompts >= 1, "evaluate.timed_prompts", "must be >= 1 (at most num_prompts are timed)")
        _check(self.timed_drafters in ("distilled", "all"), "evaluate.timed_drafters",
               f"must be 'distilled' or 'all', got {self.timed_drafters!r}")
        _check(self.draft_length in ("recommended", "decode"), "evaluate.draft_length",
               f"must be 'recommended' or 'decode' (decode.draft_length), got {self.draft_length!r}")
        _check(all(isinstance(n, str) and n.strip() for n in self.compare_drafters), "evaluate.compare_drafters",
               f"must be a list of model names or folders, e.g. [qwen2.5-coder-0.5b-instruct]; got {self.compare_drafters}")
        _check(all(isinstance(n, int) and n >= 1 for n in self.compare_vocab_sizes), "evaluate.compare_vocab_sizes",
               f"must be a list of vocabulary sizes >= 1, e.g. [32000,64000]; got {self.compare_vocab_sizes}")
        _check(len(set(self.compare_vocab_sizes)) == len(self.compare_vocab_sizes), "evaluate.compare_vocab_sizes",
               f"names a size twice: {self.compare_vocab_sizes}")
        _check(len(set(self.compare_drafters)) == len(self.compare_drafters), "evaluate.compare_drafters",
               f"names a drafter twice: {self.compare_drafters}")
        _check(self.prompts is None or bool(str(self.prompts).strip()), "evaluate.prompts",
               "must be a prompt file (JSONL or text, as data=file reads) or null for the held-out prompts")
        _check(self.target_engine in ("hf", "loop"), "evaluate.target_engine",
               f"must be hf or loop, got {self.target_engine!r}")
        _check(len(set(self.engines)) == len(self.engines), "evaluate.engines", f"names an engine twice: {self.engines}")


@dataclass
class CheckConfig:
    """``draftsmith check``: pre-flight measurements of a target/drafter pair, no training."""

    num_prompts: int = field(default=4, metadata={"help": "held-out prompts of data.* measured"})
    draft_length: int = field(default=5, metadata={"help": "K of the top-1 agreement and acceptance measurements"})
    max_new_tokens: int = field(default=48, metadata={
        "help": "tokens decoded per prompt for the acceptance measurement"})
    accuracy_threshold: float = field(default=0.7, metadata={"help": "the source article's bar for top-1 agreement"})
    max_draft_length: int = field(default=8, metadata={"help": "largest K considered for the recommendation"})

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "check.num_prompts", "must be >= 1")
        _check(self.draft_length >= 1, "check.draft_length", "must be >= 1")
        _check(self.max_new_tokens > self.draft_length, "check.max_new_tokens",
               f"must be > check.draft_length ({self.draft_length})")
        _check(0 < self.accuracy_threshold <= 1, "check.accuracy_threshold", "must be in (0, 1]")
        _check(self.max_draft_length >= 1, "check.max_draft_length", "must be >= 1")


@dataclass
class ExportConfig:
    """Stage 4: write the tuned drafter for other tools."""

    path: Optional[str] = field(default=None, metadata={"help": "destination folder; null = <run>/drafter-hf"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing export folder"})
    dtype: str = field(default="bfloat16", metadata={
        "help": "dtype of the saved weights (auto | float32 | bfloat16 | float16)"})
    gguf: bool = field(default=False, metadata={"help": "also write drafter.gguf (llama.cpp) into the export folder"})
    gguf_dtype: str = field(default="f16", metadata={"help": "f16 | bf16 | f32 | q8_0 for the GGUF's 2-D weights"})

    def __post_init__(self) -> None:
        _check(self.gguf_dtype in ("f16", "bf16", "f32", "q8_0"), "export.gguf_dtype",
               f"must be f16, bf16, f32 or q8_0, got {self.gguf_dtype!r}")
        _check(self.dtype in DTYPES, "export.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


@dataclass
class LoggerConfig:
    """Experiment tracking: none, console, jsonl (metrics file) or wandb."""

    kind: str = field(default="wandb", metadata={"help": "none | console | jsonl (metrics file) | wandb"})
    project: str = field(default="draftsmith", metadata={"help": "wandb project"})
    mode: str = field(default="offline", metadata={"help": "wandb mode: offline | online | disabled"})

    def __post_init__(self) -> None:
        kinds = ("none", "console", "jsonl", "wandb")
        _check(self.kind in kinds, "logger.kind", f"must be one of {kinds}, got {self.kind!r}")
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", "must be offline, online or disabled")


@dataclass
class InputsConfig:
    """Run folders a single stage reads. Empty = the newest complete run of that stage under outputs/."""

    generate: Optional[str] = field(default=None, metadata={"help": "a generate run, read by distill and evaluate"})
    extra_generate: list[str] = field(default_factory=list, metadata={
        "help": "more finished generate runs whose training answers distill adds to those of `generate` (same "
                "target, same store_top_k); evaluation keeps the held-out prompts of `generate`, whose prompts are "
                "dropped from these"})
    distill: Optional[str] = field(default=None, metadata={"help": "a distill run, read by evaluate and export"})
    evaluate: Optional[str] = field(default=None, metadata={
        "help": "an evaluate run, read by export (figures for the model card)"})
    sweep: Optional[str] = field(default=None, metadata={
        "help": "read by gather: a multirun folder (null = the newest under outputs/multirun)"})


@dataclass
class Config:
    """The whole configuration; ``stage`` is set by the ``draftsmith <stage>`` command."""

    stage: str = field(default="pipeline", metadata={
        "help": "the stage run, set by `draftsmith <stage>`: " + " | ".join(STAGES)})
    outputs: str = field(default="outputs", metadata={"help": "root of all run folders"})
    target: TargetConfig = field(default_factory=TargetConfig, metadata={
        "help": "the target model, whose output must not change"})
    drafter: DrafterConfig = field(default_factory=DrafterConfig, metadata={
        "help": "the draft model before distillation"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "where prompts come from"})
    generate: GenerateConfig = field(default_factory=GenerateConfig, metadata={
        "help": "stage 1: the target answers training prompts"})
    distill: DistillConfig = field(default_factory=DistillConfig, metadata={
        "help": "stage 2: the drafter learns the target's distributions"})
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={
        "help": "the speculative decoder evaluate runs"})
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig, metadata={
        "help": "stage 3: the drafter measured before and after"})
    export: ExportConfig = field(default_factory=ExportConfig, metadata={
        "help": "stage 4: the tuned drafter written for other tools"})
    check: CheckConfig = field(default_factory=CheckConfig, metadata={
        "help": "draftsmith check: pre-flight measurements, no training"})
    logger: LoggerConfig = field(default_factory=LoggerConfig, metadata={"help": "experiment tracking"})
    inputs: InputsConfig = field(default_factory=InputsConfig, metadata={
        "help": "run folders a single stage reads (null = the newest complete run of that stage under outputs/)"})
    experiment: Optional[str] = field(default=None, metadata={"help": "name of the chosen experiment, for the record"})

    def __post_init__(self) -> None:
        _check(self.stage in STAGES, "stage", f"must be one of {STAGES}, got {self.stage!r}")



def _slug(text: str) -> str:
    """A single folder name from override text: no "/" and no quotes (Hydra's quoting of values that hold
    commas), at most 120 characters."""
    text = str(text).replace("/", "_").replace("\\", "_").replace("'", "").replace('"', "") or "default"
    return text if len(text) <= 120 else text[:100] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def annotated_yaml(node: DictConfig | dict, cls: type | None = Config, width: int = 100) -> str:
    """``OmegaConf.to_yaml(node)`` (unresolved) with each key's help, its field's ``metadata["help"]``, as a YAML
    comment: after the value where the line fits in ``width`` (aligned within its section), else wrapped onto
    comment lines above the key. Keys that ``cls`` lacks (a free-form value's) have none."""
    tree = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
    return "\n".join(_annotated_lines(tree, cls, "", width)) + "\n"


def _annotated_lines(tree: dict, cls: type | None, indent: str, width: int) -> list[str]:
    """The lines of :func:`annotated_yaml` for the keys of ``tree``, a section at ``indent``, and theirs."""
    known = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    entries = []
    for key, value in tree.items():
        f = known.get(key)
        lines = [indent + line for line in OmegaConf.to_yaml({key: value}).splitlines()]  # OmegaConf's quoting
        nested = isinstance(value, dict) and bool(value)  # a section: its `key:` line here, its keys below
        entries.append((lines[:1] if nested else lines, f.metadata.get("help", "") if f else "", value, nested, f))
    column = max((len(lines[0]) for lines, *_ in entries if len(lines) == 1 and len(lines[0]) <= 40), default=0) + 2
    out: list[str] = []
    for lines, help, value, nested, f in entries:
        trailing = lines[0].ljust(max(column, len(lines[0]) + 2)) + "# " + help
        if help and len(lines) == 1 and len(trailing) <= width:
            out.append(trailing)
        else:
            wrapped = textwrap.wrap(help, width - len(indent) - 2, break_on_hyphens=False)
            out += [f"{indent}# {line}" for line in wrapped]
            out += lines
        if nested:
            section = f.default_factory if f else None
            out += _annotated_lines(value, section if dataclasses.is_dataclass(section) else None, indent + "  ", width)
    return out


def _config_help(*, _root_: DictConfig) -> str:
    """``${draftsmith_config_help:}`` in conf/hydra/default.yaml's help template: the composed config, Hydra's
    own part left out, as :func:`annotated_yaml` writes it, each ``$`` doubled for the template's
    ``string.Template``."""
    tree = OmegaConf.to_container(_root_, resolve=False)
    tree.pop("hydra", None)
    return annotated_yaml(tree).replace("$", "$$")


def register_configs() -> None:
    """Register :class:`Config` as ``draftsmith_schema`` (first entry of conf/config.yaml's defaults),
    the ``slug`` resolver used by the sweep folder names and ``draftsmith_config_help`` used by ``--help``."""
    ConfigStore.instance().store(name="draftsmith_schema", node=Config)
    if not OmegaConf.has_resolver("slug"):
        OmegaConf.register_new_resolver("slug", _slug)
    if not OmegaConf.has_resolver("draftsmith_config_help"):
        OmegaConf.register_new_resolver("draftsmith_config_help", _config_help)


def _unknown_keys(node: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys of ``node`` that the schema lacks (a ``+key=value`` override slips past Hydra's struct check)."""
    unknown = []
    for key in node.keys():
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif isinstance(node[key], DictConfig) and isinstance(schema[key], DictConfig):
            unknown += _unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return unknown


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed Hydra config into checked dataclasses.

    Raises:
        ConfigError: a value is out of range; the message names the key.
    """
    if isinstance(cfg, Config):
        return cfg
    unknown = _unknown_keys(cfg, OmegaConf.structured(Config))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}: check the spelling (`--cfg job` lists every key)")
    # inf passes every "> 0" check and breaks training or decoding later; nan would fail "> 0" unexplained
    for section, values in cfg.items():
        for key, value in (values.items() if isinstance(values, DictConfig) else ()):
            _check(not isinstance(value, float) or math.isfinite(value), f"{section}.{key}",
                   f"must be a finite number, got {value}")
    obj: Any = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        raise ConfigError("the composed config is not a draftsmith Config: keep 'draftsmith_schema' first in conf/config.yaml")
    return obj
