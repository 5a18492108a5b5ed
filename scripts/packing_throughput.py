"""How much faster does distill.packing train? Real tokens per second with and without, on the same steps.

    python scripts/packing_throughput.py --generate outputs/generate/<run> --steps 10 --batch-size 8

Trains a LoRA drafter (``--drafter`` wrapped as a sibling, rank ``--lora-r``) with
``distill.training.loop.train_drafter`` twice from the same start on the same examples, once with padded
micro-batches and once packed (``distill.packing``), for ``--warmup-steps`` + ``--steps`` optimizer steps
each. Against the target's stored top-k log-probs when the generate run kept them (``generate.store_top_k``),
else against ``--target`` scored online. The figures come from the timed steps (``metrics.jsonl``, the
warm-up steps left out): **real tokens/s** (prompt + answer tokens, no padding, per second of optimizer
step), completion tokens/s (what the loop's bar shows), and the share of the micro-batches' cells that hold
a real token. Prints a Markdown table with the packed / padded ratio and writes it with the raw figures to
``--out``. Run it on an otherwise idle machine: the two modes run one after the other.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from distill.config import DistillConfig
from distill.data.generated import load_generated
from distill.drafters.build import LoraSettings, build_drafter, freeze_embeddings
from distill.errors import DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.hardware import auto_dtype
from distill.models.loading import load_model
from distill.training.loop import METRICS_FILE, collate, train_drafter
from distill.training.packing import pack_batch


def step_batches(examples: list[dict], batch_size: int, steps: int, seed: int) -> list[list[dict]]:
    """The examples of each optimizer step (one micro-batch a step), in the loop's documented data order:
    epoch e visits them in ``numpy.random.default_rng([seed, e]).permutation(n)``."""
    order: list[int] = []
    epoch = 0
    while len(order) < batch_size * steps:
        order += np.random.default_rng([seed, epoch]).permutation(len(examples)).tolist()
        epoch += 1
    return [[examples[i] for i in order[s * batch_size:(s + 1) * batch_size]] for s in range(steps)]


def batch_figures(batch: list[dict], *, packed: bool, max_seq_len: int) -> dict:
    """Real tokens (no padding), completion tokens and cells (rows x width) of one micro-batch."""
    padded = collate(batch, pad_token_id=0, max_seq_len=max_seq_len)  # the pad id changes no count
    shape = (pack_batch(padded, max_seq_len=max_seq_len, pad_token_id=0) if packed else padded)["input_ids"].shape
    return {"real": int(padded["attention_mask"].sum()), "completion": int(padded["loss_mask"].sum()),
            "cells": shape[0] * shape[1]}


def run_mode(base, target, examples: list[dict], args, *, packed: bool, folder: Path) -> dict:
    """Train a fresh copy of ``base`` in one mode; the timed steps' token and time totals.

    ``args.lora_r``: the LoRA rank, or ``None`` for a full fine-tune with the embeddings and head frozen (as
    ``distill.method=full`` trains).

    Raises:
        DraftsmithError: the loop's completion tokens differ from the ones this script expects (its data
            order is no longer the documented one).
    """
    lora = None if args.lora_r is None else LoraSettings(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0)
    drafter = build_drafter(copy.deepcopy(base), init="sibling", lora=lora)
    if lora is None:
        freeze_embeddings(drafter)
    total = args.warmup_steps + args.steps
    settings = DistillConfig(method="lora" if lora else "full", max_steps=total, batch_size=args.batch_size,
                             max_seq_len=args.max_seq_len,
                             checkpoint_every=0, keep_checkpoints=1, mixed_precision=args.mixed_precision,
                             target_source="online" if target is not None else "stored", packing=packed,
                             val_fraction=0.0, seed=args.seed)
    train_drafter(drafter, target, examples, settings, output_dir=folder, progress=False)
    records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines()]
    sums = {"steps": 0, "seconds": 0.0, "real": 0, "completion": 0, "cells": 0}
    for record, batch in zip(records, step_batches(examples, args.batch_size, total, args.seed)):
        figures = batch_figures(batch, packed=packed, max_seq_len=args.max_seq_len)
        if figures["completion"] != record["tokens"]:
            raise DraftsmithError(f"step {record['step']}: the loop trained on {record['tokens']} completion "
                                  f"tokens, this script expected {figures['completion']}: its data order is stale")
        if record["step"] > args.warmup_steps:
            sums["steps"] += 1
            sums["seconds"] += record["tokens"] / record["tokens_per_s"]  # the step's own time, no checkpoint
            for key in ("real", "completion", "cells"):
                sums[key] += figures[key]
    return {**sums, "real_tokens_per_s": sums["real"] / sums["seconds"],
            "completion_tokens_per_s": sums["completion"] / sums["seconds"], "density": sums["real"] / sums["cells"]}


def usable_examples(generate: Path, stored: bool, count: int) -> list[dict]:
    """Those of the first ``count`` examples of a generate run that have a prompt and an answer token (the loop
    would skip the others)."""
    dataset, _, _ = load_generated(generate)
    columns = ["prompt_ids", "completion_ids"] + (["top_k_ids", "top_k_logprobs"] if stored else [])
    rows = dataset.select(range(min(count, len(dataset)))).select_columns(columns)
    return [{c: row[c] for c in columns} for row in rows if row["prompt_ids"] and row["completion_ids"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", required=True, help="a finished generate run")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", help="the drafter's base model")
    parser.add_argument("--target", default=None, help="the target, scored online when the run stored no top-k "
                        "log-probs (default: the generate run's target)")
    parser.add_argument("--target-dtype", default="auto", help="auto: bfloat16 where the hardware has bf16 units")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed optimizer steps before them")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per micro-batch (and per step)")
    parser.add_argument("--max-seq-len", type=int, default=512, help="tokens per example, and per packed row")
    parser.add_argument("--num-examples", type=int, default=256, help="examples of the run trained on, at most")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--mixed-precision", default="auto", help="distill.mixed_precision")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/packing_throughput", help="folder for the .md / .json")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup_steps < 0 or args.batch_size < 1:
        parser.error("--steps >= 1, --warmup-steps >= 0 and --batch-size >= 1")

    try:
        manifest = load_generated(Path(args.generate))[2]
    except DraftsmithError as error:  # a wrong folder: say so before any model loads
        parser.error(f"--generate: {error}")
    stored = bool(manifest.get("store_top_k"))
    examples = usable_examples(Path(args.generate), stored, args.num_examples)
    if not examples:
        parser.error(f"--generate: {args.generate} holds no example with an answer")
    target = None
    if not stored:
        name = args.target or manifest["target"]["name"]
        dtype = auto_dtype() if args.target_dtype == "auto" else args.target_dtype
        target = load_model(name, dtype=dtype)[0]
    base = load_model(args.drafter, dtype="float32")[0]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="packing_throughput-") as tmp:
        for mode in ("padded", "packed"):
            rows[mode] = run_mode(base, target, examples, args, packed=mode == "packed", folder=Path(tmp) / mode)
    ratio = rows["packed"]["real_tokens_per_s"] / rows["padded"]["real_tokens_per_s"]
    table = render(rows, ratio, args, stored, len(examples))
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "packing_throughput.md", table)
    write_json_atomic(out / "packing_throughput.json", {"args": vars(args), "stored_targets": stored,
                                                        "examples": len(examples), "modes": rows, "ratio": ratio})


def render(rows: dict, ratio: float, args, stored: bool, num_examples: int) -> str:
    """The Markdown table of both modes and the packed / padded ratio of real tokens/s."""
    lines = [f"drafter `{args.drafter}` + LoRA r={args.lora_r}, {'stored top-k' if stored else 'online'} targets, "
             f"{num_examples} examples of {args.generate}; {args.steps} timed steps of {args.batch_size} examples "
             f"(after {args.warmup_steps} untimed), max_seq_len {args.max_seq_len}", "",
             "| micro-batches | real tokens/s | completion tokens/s | real tokens | cells holding a real token |",
             "|---|---|---|---|---|"]
    lines += [f"| {mode} | {r['real_tokens_per_s']:.1f} | {r['completion_tokens_per_s']:.1f} | {r['real']} | "
              f"{r['density']:.3f} |" for mode, r in rows.items()]
    lines += ["", f"packed / padded real tokens/s: {ratio:.3f}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as error:  # a model not installed, a bad folder: the message says what to do
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
