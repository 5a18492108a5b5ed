"""Training an EAGLE-3 head: the target runs online in every step, the head drafts ``ttt_steps`` ahead.

Each micro-batch: one teacher-forced target forward (no gradient) gives the aux-layer states the head reads
and the target's next-token distributions at the answer positions; the head is unrolled ``ttt_steps`` steps
at every entry (``decode.eagle3.unroll``, the training-time test of Li et al. 2025, arXiv:2503.01840,
Sec. 3.2) and step j's divergence from the target (restricted to the draft vocabulary and renormalised, as
EAGLE-3 and SpecForge train) is weighted ``0.8 ** j`` (SpecForge's ``train_eagle3.py``). Nothing of the target
is stored on disk (its states are about 12 KB a token for a 1.5B target).

Checkpoints, resume and the metrics files are the sibling drafter's (``distill.training.checkpoint``,
``metrics.jsonl``, ``validation.jsonl``); one process (DDP and FSDP of heads are not built yet).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

from decode.eagle3.features import aux_states_of
from decode.eagle3.head import WEIGHTS_FILE, Eagle3Head
from decode.eagle3.simulation import simulate_head_greedy
from decode.eagle3.unroll import unroll
from decode.metrics import DecodeStats
from distill.config import DistillConfig
from distill.errors import DraftsmithError
from distill.training.checkpoint import (
    checkpoint_due,
    prune_checkpoints,
    read_state,
    save_checkpoint,
    set_rng_state,
)
from distill.training.losses import distillation_loss
from distill.training.loop import METRICS_FILE, VALIDATION_FILE, _keep_steps_up_to, collate

log = logging.getLogger(__name__)

STEP_WEIGHT = 0.8  # step j's loss is weighted STEP_WEIGHT ** j (SpecForge)
MAX_GRAD_NORM = 1.0


def _shift_left(x: torch.Tensor, shift: int, fill) -> torch.Tensor:
    """``x`` ``(batch, T)`` moved left by ``shift`` along T, ``fill`` at the end."""
    out = torch.full_like(x, fill)
    if shift < x.shape[1]:
        out[:, : x.shape[1] - shift] = x[:, shift:]
    return out


@dataclass
class HeadLoss:
    """One batch's training-time-test loss and figures.

    Attributes:
        loss: ``sum_j 0.8**j * mean divergence of step j`` (0-dim, with graph when grad is on).
        agree: per step, the positions where the head's argmax is the target's.
        counted: per step, the positions it predicts.
        drafts: with ``draft_steps``: ``(batch, T, draft_steps)`` target ids of the head's drafts at every entry
            (``decode.eagle3.simulation``'s ``drafts`` by block start), else None.
    """

    loss: torch.Tensor
    agree: list[float]
    counted: list[int]
    drafts: torch.Tensor | None = None


def head_loss(head: Eagle3Head, target, batch: dict, *, steps: int, kind: str = "fkl", jsd_beta: float = 0.5,
              temperature: float = 1.0, draft_steps: int = 0) -> HeadLoss:
    """The weighted training-time-test loss of one batch.

    Args:
        head: the head being trained; target: its target (frozen).
        batch: ``distill.training.loop.collate``'s ``input_ids``, ``attention_mask``, ``loss_mask`` ``(batch, T)``
            (``loss_mask[t]``: the token after t is an answer token).
        steps: draft steps per entry (``distill.ttt_steps``) in the loss.
        kind, jsd_beta, temperature: the divergence (``distill.training.losses.distillation_loss``).
        draft_steps: also return the head's first ``draft_steps`` drafts at every entry (validation: the exact
            simulation from the same target pass).

    Returns:
        :class:`HeadLoss`. Step j at entry s predicts the token after position ``s + j + 1`` and counts where
        ``loss_mask[s + j + 1]``.
    """
    input_ids, mask = batch["input_ids"], batch["loss_mask"]
    with torch.no_grad():
        keep_logits, states = _target_pass(target, batch, head.config.aux_layers)
        rows = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        rows[mask] = torch.arange(int(mask.sum()), device=mask.device)
        draft_ids = head.draft_to_target.to(keep_logits.device)
        target_draft = keep_logits.index_select(-1, draft_ids)  # (N, D): renormalised by the loss's softmax
        target_best = keep_logits.argmax(-1)
        del keep_logits
    outputs = unroll(head, target.get_input_embeddings(), input_ids, states.to(head.norm.weight.dtype),
                     max(steps, draft_steps))
    result = HeadLoss(sum(p.sum() for p in head.parameters()) * 0.0, [], [])
    for j, normed in enumerate(outputs[:steps]):
        step_rows = _shift_left(rows, j + 1, -1)
        used = step_rows >= 0
        result.counted.append(int(used.sum()))
        if not result.counted[-1]:
            result.agree.append(0.0)
            continue
        student = head.lm_head(normed[used])  # (M, D)
        teacher = target_draft[step_rows[used]].to(student.device)
        ones = torch.ones(1, student.shape[0], dtype=torch.bool, device=student.device)
        result.loss = result.loss + STEP_WEIGHT ** j * distillation_loss(
            student[None], teacher[None], ones, kind=kind, jsd_beta=jsd_beta, temperature=temperature)
        with torch.no_grad():
            result.agree.append(float((draft_ids[student.argmax(-1)] == target_best[step_rows[used]]).sum()))
    if draft_steps:
        with torch.no_grad():
            result.drafts = torch.stack([draft_ids[head.lm_head(normed).argmax(-1)]
                                         for normed in outputs[:draft_steps]], dim=-1)
    return result


def _target_pass(target, batch: dict, aux_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits at the loss positions ``(N, V)`` and its aux states ``(batch, T, 3 * hidden)``."""
    with aux_states_of(target, aux_layers) as states:
        logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                        logits_to_keep=batch["loss_mask"]).logits
    return logits.reshape(-1, logits.shape[-1]), states[-1]


@dataclass
class _HeadRun:
    """What ``distill.training.checkpoint.save_checkpoint`` reads of a run."""

    accelerator: Any
    optimizer: Any
    scheduler: Any
    plain: Eagle3Head
    data_key: dict


def _example_stream(num_examples: int, seed: int, start: int) -> Iterator[int]:
    """Example indices, a new shuffle (seeded by ``seed`` and the epoch) every epoch, from position ``start``."""
    position = 0
    for epoch in range(10**9):
        order = list(range(num_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for index in order:
            if position >= start:
                yield index
            position += 1


def train_head(head: Eagle3Head, target, examples: Sequence[dict], settings: DistillConfig, *, output_dir: Path,
               pad_token_id: int, resume_from: Path | None = None, val_examples: Sequence[dict] | None = None,
               logger: Any = None, progress: bool = True, validation_draft_length: int = 0) -> dict[str, Any]:
    """Train ``head`` in place on the target's answers for ``settings.max_steps`` optimizer steps.

    AdamW over the head's parameters (the target and its embedding frozen), the schedule and warmup of
    ``settings``, gradient norm clipped to 1.0; ``batch_size * grad_accum`` examples a step; checkpoints
    ``checkpoint-<step>/`` in ``output_dir`` as the sibling's (``checkpoint_every``, ``checkpoint_at``, the last
    step), and ``resume_from`` continues one exactly (weights, optimizer, scheduler, data position, RNG).

    Returns:
        ``{"steps", "final_loss", "tokens_seen", "train_s", "tokens_per_s", "validation_before",
        "validation_after", "checkpoint"}``.

    Raises:
        DraftsmithError: no usable example, a NaN/inf loss, or a checkpoint from other data.
    """
    d = settings
    if not examples:
        raise DraftsmithError("no training examples: generate more prompts")
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    target.requires_grad_(False)
    head.to(accelerator.device).train()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=d.lr, weight_decay=d.weight_decay)
    # as the sibling's loop: linear warmup, then linear decay to 0 or constant
    scheduler = get_linear_schedule_with_warmup(optimizer, d.warmup_steps, d.max_steps) \
        if d.lr_schedule == "linear" else get_constant_schedule_with_warmup(optimizer, d.warmup_steps)
    run = _HeadRun(accelerator, optimizer, scheduler, head,
                   {"num_examples": len(examples), "seed": d.seed, "batch_size": d.batch_size,
                    "grad_accum": d.grad_accum, "num_processes": 1})
    state = _resume(run, resume_from) if resume_from else {"step": 0, "examples_seen": 0, "tokens_seen": 0}
    val_args = dict(steps=d.ttt_steps, draft_length=validation_draft_length, pad_token_id=pad_token_id,
                    max_seq_len=d.max_seq_len, batch_size=d.batch_size, kind=d.loss)
    before = state.get("validation_before") or (validate_head(head, target, val_examples, **val_args)
                                                if val_examples else None)
    sink = _HeadSink(output_dir, logger, progress, state["step"], d.max_steps)
    if before and not state["step"]:  # a resumed run's files hold it already
        sink.validation(0, before)
    stream = _example_stream(len(examples), d.seed, state["examples_seen"])
    seen, t_start, history, checkpoint = dict(state), time.perf_counter(), [], None
    try:
        for step in range(state["step"] + 1, d.max_steps + 1):
            record = _head_step(run, target, examples, stream, step, d, seen, pad_token_id)
            history.append(record["loss"])
            sink.step(record)
            if val_examples and d.validate_every and step % d.validate_every == 0 and step < d.max_steps:
                sink.validation(step, validate_head(head, target, val_examples, **val_args))
            if checkpoint_due(step, max_steps=d.max_steps, checkpoint_every=d.checkpoint_every,
                              checkpoint_at=d.checkpoint_at):
                checkpoint = save_checkpoint(run, output_dir, step=step, examples_seen=seen["examples_seen"],
                                             tokens_seen=seen["tokens_seen"], validation_before=before)
                prune_checkpoints(output_dir, d.keep_checkpoints, protected=d.checkpoint_at)
        after = validate_head(head, target, val_examples, **val_args) if val_examples else None
        if after:
            sink.validation(d.max_steps, after)
    finally:
        sink.close()
    train_s = time.perf_counter() - t_start
    trained = seen["tokens_seen"] - state["tokens_seen"]
    return {"steps": d.max_steps, "final_loss": history[-1] if history else None, "tokens_seen": seen["tokens_seen"],
            "train_s": round(train_s, 2), "tokens_per_s": trained / max(train_s, 1e-9),
            "validation_before": before, "validation_after": after, "checkpoint": str(checkpoint) if checkpoint else None}


def _resume(run: _HeadRun, path: Path) -> dict:
    """Load ``checkpoint-<step>`` at ``path`` into ``run``; returns its state (step, data position, ...)."""
    from safetensors.torch import load_file

    state = read_state(path, run.data_key)
    run.plain.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    run.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    run.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    set_rng_state(state["rng"])
    log.info("resuming the head from %s (step %d)", path, state["step"])
    return state


def _head_step(run: _HeadRun, target, examples, stream, step: int, d: DistillConfig, seen: dict,
               pad_token_id: int) -> dict:
    """One optimizer step over ``grad_accum`` micro-batches; returns its record and advances ``seen``."""
    head, t0 = run.plain, time.perf_counter()
    lr_now = run.scheduler.get_last_lr()[0]
    autocast = torch.autocast(run.accelerator.device.type, dtype=torch.bfloat16) \
        if d.mixed_precision == "bf16" else contextlib.nullcontext()
    loss_sum, agree, counted, tokens = 0.0, [0.0] * d.ttt_steps, [0] * d.ttt_steps, 0
    for _ in range(d.grad_accum):
        chosen = [examples[next(stream)] for _ in range(d.batch_size)]
        batch = {k: v.to(run.accelerator.device) for k, v in
                 collate(chosen, pad_token_id=pad_token_id, max_seq_len=d.max_seq_len).items()}
        with autocast:
            result = head_loss(head, target, batch, steps=d.ttt_steps, kind=d.loss, jsd_beta=d.jsd_beta,
                               temperature=d.temperature)
        loss, step_agree, step_counted = result.loss, result.agree, result.counted
        if not torch.isfinite(loss):
            raise DraftsmithError(f"the head's loss became {loss.item()} at step {step}: lower distill.lr")
        (loss / d.grad_accum).backward()
        loss_sum += loss.item() / d.grad_accum
        agree = [a + b for a, b in zip(agree, step_agree)]
        counted = [a + b for a, b in zip(counted, step_counted)]
        tokens += int(batch["loss_mask"].sum())
        seen["examples_seen"] += len(chosen)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(head.parameters(), MAX_GRAD_NORM))
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    seen["tokens_seen"] += tokens
    record = {"step": step, "loss": loss_sum, "lr": lr_now, "tokens": tokens, "grad_norm": grad_norm,
              "tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9)}
    record.update({f"step{j + 1}_agreement": a / max(c, 1) for j, (a, c) in enumerate(zip(agree, counted))})
    return record


@torch.no_grad()
def validate_head(head: Eagle3Head, target, examples: Sequence[dict], *, steps: int, draft_length: int,
                  pad_token_id: int, max_seq_len: int, batch_size: int, kind: str = "fkl",
                  progress: bool = True) -> dict[str, float]:
    """Held-out loss and per-step top-1 agreement and, with ``draft_length`` > 0, the tau and acceptance rate
    greedy decoding at K = ``draft_length`` gets on the examples' answers (``decode.eagle3.simulation``'s
    replay, from the same target pass as the loss: exact where the answers are the target's greedy ones, a
    teacher-forced proxy on answers the target scored).

    Returns:
        ``{"loss", "step<j>_agreement", "tokens", "examples"}`` plus ``simulated_tau``, ``simulated_acceptance``.
    """
    from tqdm.auto import tqdm

    was_training = head.training
    head.eval()
    loss_sum, agree, counted, tokens, blocks = 0.0, [0.0] * steps, [0] * steps, 0, []
    device = head.device
    try:
        for start in tqdm(range(0, len(examples), batch_size), desc="validation", unit="batch", leave=False,
                          disable=not progress):
            chosen = examples[start:start + batch_size]
            batch = {k: v.to(device) for k, v in collate(chosen, pad_token_id=pad_token_id,
                                                         max_seq_len=max_seq_len).items()}
            result = head_loss(head, target, batch, steps=steps, kind=kind, draft_steps=draft_length)
            n = int(batch["loss_mask"].sum())
            loss_sum += result.loss.item() * n
            tokens += n
            agree = [a + b for a, b in zip(agree, result.agree)]
            counted = [a + b for a, b in zip(counted, result.counted)]
            if draft_length:
                blocks += _replayed(chosen, batch, result.drafts, draft_length)
    finally:
        head.train(was_training)
    figures = {"loss": loss_sum / max(tokens, 1), "tokens": tokens, "examples": len(examples)}
    figures.update({f"step{j + 1}_agreement": a / max(c, 1) for j, (a, c) in enumerate(zip(agree, counted))})
    if blocks:
        pooled = DecodeStats.merge(blocks)
        figures.update(simulated_tau=pooled.mean_accepted_tokens, simulated_acceptance=pooled.acceptance_rate)
    return figures


def _replayed(examples: Sequence[dict], batch: dict, drafts: torch.Tensor, draft_length: int) -> list[DecodeStats]:
    """Each example's greedy blocks at K = ``draft_length`` from the head's drafts ``(batch, T, K)``: the block at
    answer position p starts at entry ``prompt_len + p - 2`` (as truncated by ``collate``)."""
    out = []
    for row, example in enumerate(examples):
        mask = batch["loss_mask"][row]
        if not mask.any():
            continue
        first = int(mask.nonzero()[0])  # prompt_len - 1
        answer = batch["input_ids"][row, first + 1: first + 1 + int(mask.sum())].tolist()
        rows = drafts[row].tolist()
        by_start = [rows[first - 1 + p] if first - 1 + p >= 0 else [] for p in range(len(answer))]
        cut = example.get("finish_reason") == "length" or len(answer) < len(example["completion_ids"])
        limit = len(answer) + (0 if cut else draft_length + 1)
        out.append(simulate_head_greedy(by_start, answer, draft_length=draft_length, max_new_tokens=limit))
    return out


class _HeadSink:
    """``metrics.jsonl``, ``validation.jsonl``, the logger and a progress bar with loss, tokens/s and agreement."""

    def __init__(self, run_dir: Path, logger: Any, progress: bool, start_step: int, max_steps: int):
        from tqdm.auto import tqdm

        _keep_steps_up_to(run_dir / METRICS_FILE, start_step, create=True)  # a resumed run redoes later steps
        _keep_steps_up_to(run_dir / VALIDATION_FILE, start_step)
        self.metrics = open(run_dir / METRICS_FILE, "a", encoding="utf-8")
        self.validations = open(run_dir / VALIDATION_FILE, "a", encoding="utf-8")
        self.logger = logger
        self.bar = tqdm(total=max_steps, initial=start_step, desc="distill (EAGLE-3 head)", unit="step",
                        disable=not progress, dynamic_ncols=True)

    def step(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.logger is not None:
            self.logger.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=record["step"])
        self.bar.update(1)
        self.bar.set_postfix_str(f"loss {record['loss']:.3f}, {record['tokens_per_s']:.0f} tok/s, "
                                 f"step1 top-1 {record.get('step1_agreement', 0):.3f}")

    def validation(self, step: int, figures: dict) -> None:
        self.validations.write(json.dumps({"step": step, **figures}) + "\n")
        self.validations.flush()
        if self.logger is not None:
            self.logger.log({f"val/{k}": v for k, v in figures.items()}, step=step)
        tau = f", simulated tau {figures['simulated_tau']:.2f}" if "simulated_tau" in figures else ""
        self.bar.write(f"validation at step {step}: loss {figures['loss']:.3f}, step1 top-1 "
                       f"{figures.get('step1_agreement', 0):.3f}{tau}")

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.validations.close()
