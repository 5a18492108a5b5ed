"""Benchmark the bundled speculative decoder against transformers, side by side in one run.

    python scripts/benchmark_decoder.py --draft-lengths 1 2 3 4 6 --schedules constant heuristic auto \
        --num-prompts 6 --max-new-tokens 96

On the same prompts (by default the pipeline's held-out split of the mixed HumanEval + MT-Bench set) it
measures the target alone with transformers ``generate`` once, then for every draft length K and
schedule: our decoder and transformers' assisted generation with the same drafter, K, schedule and
confidence threshold. Prints a Markdown table (acceptance, tau, tokens/s, speedup, ours / HF, c,
theoretical speedup and measured / theoretical, and one block's milliseconds measured against its draft and
verify forwards timed alone: measured / cost model near 1 means the loop costs what its forwards cost), and writes it with the raw figures (per category and
per position included) and a plot of speedup vs K to ``--out``. Figures belong to the torch stack on
this machine (its 2 CPU cores here).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from decode.benchmark import benchmark, hf_assisted_defaults, run_target_alone
from decode.cpu_linear import use_onednn_linear
from decode.quantization import QUANTIZATIONS, drafter_for_decoding, quantize_drafter, resolve_quantization
from distill.data.prompts import encode_prompt, load_prompts, split_prompts
from distill.errors import DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.hardware import auto_dtype
from distill.models.loading import eos_token_ids, load_model

COLUMNS = ("| K | schedule | acceptance | tau | mean K | ours tok/s | HF assisted tok/s | ours / HF | speedup | "
           "HF speedup | c | theoretical | measured / theoretical | verify cost | block ms: measured / draft + verify "
           "| measured / cost model | identical (share of tokens before divergence) |")


def _row(k, schedule, r) -> str:
    hf = r["baselines"]["hf_assisted"] or {}
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    return (f"| {r['draft_length'] if schedule == 'auto' else k} | {schedule} | {r['acceptance_rate']:.3f} | "
            f"{r['mean_accepted_tokens']:.2f} | {r['mean_draft_length']:.2f} | {r['speculative_tokens_per_s']:.2f} | "
            f"{fmt(hf.get('tokens_per_s'), '{:.2f}')} | {fmt(hf.get('ours_over_hf'), '{:.2f}x')} | "
            f"{r['speedup']:.2f}x | {fmt(hf.get('speedup'), '{:.2f}x')} | {r['cost_ratio']:.3f} | "
            f"{r['theoretical_speedup']:.2f}x | {r['measured_over_theoretical']:.2f} | {fmt(r.get('verify_cost'), '{:.2f}')} | "
            f"{_block(r.get('block_seconds'))} | {fmt((r.get('block_seconds') or {}).get('measured_over_cost_model'), '{:.2f}')} | "
            f"{r['outputs_match_target']} "
            f"({fmt(r.get('identical_token_fraction'), '{:.3f}')}) |")


def _block(seconds: dict | None) -> str:
    """``measured / draft + verify`` milliseconds of one block (see ``decode.benchmark.block_seconds``)."""
    if not seconds:
        return "-"
    return f"{seconds['measured'] * 1e3:.0f} / {seconds['draft'] * 1e3:.0f} + {seconds['verify'] * 1e3:.0f}"


def _plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, schedule in enumerate(("constant", "heuristic")):
        points = sorted((k, r) for (k, s), r in rows.items() if s == schedule)
        if points:
            ax.plot([k for k, _ in points], [r["speedup"] for _, r in points], marker="o", color=f"C{i}",
                    label=f"ours ({schedule})")
            hf = [(k, r["baselines"]["hf_assisted"]) for k, r in points if r["baselines"]["hf_assisted"]]
            if hf:
                ax.plot([k for k, _ in hf], [h["speedup"] for _, h in hf], marker="s", ls="--", color=f"C{i}",
                        alpha=0.6, label=f"HF assisted ({schedule})")
    constant = sorted((k, r) for (k, s), r in rows.items() if s == "constant")
    if constant:
        ax.plot([k for k, _ in constant], [r["theoretical_speedup"] for _, r in constant], ls=":", color="grey",
                label="theoretical (Thm 3.8)")
    for (k, s), r in rows.items():
        if s == "auto":
            ax.scatter([r["draft_length"]], [r["speedup"]], marker="*", s=150, color="C3", label="ours (auto K)", zorder=3)
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set(xlabel="draft length K (starting K for heuristic)", ylabel="speedup vs target alone (HF generate)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _batched(target, drafter, prompts, args, eos) -> dict:
    """Throughput of ``speculative_generate_batch`` over all prompts at batch size B and at 1, same K."""
    import time

    from decode.batched import speculative_generate_batch
    from decode.metrics import DecodeStats

    k = args.draft_lengths[0]

    def run(batch_size: int):
        outputs, seconds = [], 0.0
        for i in range(0, len(prompts), batch_size):
            chunk = [ids for _, _, ids in prompts[i:i + batch_size]]
            start = time.perf_counter()
            outputs += speculative_generate_batch(target, drafter, chunk, draft_length=k, pad_token_id=eos[0],
                                                  max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
            seconds += time.perf_counter() - start  # prefill included, as a serving system sees it
        pooled = DecodeStats.merge([o.stats for o in outputs])
        return outputs, pooled.new_tokens / seconds, pooled.mean_accepted_tokens

    one, one_tps, one_tau = run(1)
    many, many_tps, many_tau = run(args.batch_size)
    return {"batch_size": args.batch_size, "draft_length": k, "tokens_per_s": many_tps,
            "mean_accepted_tokens": many_tau, "batch1_tokens_per_s": one_tps, "batch1_mean_accepted_tokens": one_tau,
            "outputs_match_batch1": all(torch.equal(a.new_tokens, b.new_tokens) for a, b in zip(one, many))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct",
                        help="a model name/path, or the drafter/ folder of a distill run")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: bfloat16 where the hardware has bf16 units, else float32")
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--schedules", nargs="+", default=["constant"], choices=("constant", "heuristic", "auto"),
                        help="auto runs once (K chosen by calibration), the others once per K")
    parser.add_argument("--confidence-threshold", type=float, default=0.0)
    parser.add_argument("--drafter-quantization", default="auto", choices=QUANTIZATIONS,
                        help="how our decoder runs the drafter (auto = int8-dynamic on CPU)")
    parser.add_argument("--cpu-linear", default="onednn", choices=("onednn", "torch"),
                        help="float32 linear layers on a CPU: oneDNN (decode.cpu_linear, what the stages use) or "
                             "torch's own (MKL), to compare the two")
    parser.add_argument("--hf-drafter", default="same", choices=("same", "stored"),
                        help="HF assisted gets the same (possibly quantized) drafter module, or the stored one")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="also run the batched decoder (decode.batched) at this batch size and K = the first "
                             "--draft-lengths value, and report its throughput against batch size 1")
    parser.add_argument("--hf-defaults", action="store_true",
                        help="also time generate(assistant_model=drafter) with transformers' default settings")
    parser.add_argument("--no-hf-assisted", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--source", default="mixed", help="prompt source (humaneval, mtbench, sharegpt, mixed)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmark_decoder"))
    args = parser.parse_args()
    args.dtype = auto_dtype() if args.dtype == "auto" else args.dtype  # the labels name what ran
    if min(args.draft_lengths) < 1:
        parser.error("--draft-lengths must all be >= 1")

    target, tokenizer, _ = load_model(args.target, dtype=args.dtype)
    stored, _, _ = load_model(args.drafter, dtype=args.dtype)
    quantization = resolve_quantization(args.drafter_quantization, target.device)
    if args.cpu_linear == "onednn":
        use_onednn_linear(target)
        # with --hf-drafter stored, HF gets the stored module untouched: ours then runs a swapped copy
        drafter = drafter_for_decoding(stored if args.hf_drafter == "same" else copy.deepcopy(stored), quantization)
    else:
        drafter = quantize_drafter(stored, quantization)
    hf_drafter = drafter if args.hf_drafter == "same" else stored
    # the same held-out prompts as the pipeline's evaluate stage (seed 0)
    _, held_out = split_prompts(load_prompts(args.source), num_train=0, num_eval=args.num_prompts, seed=0)
    prompts = [(p.id, p.category, encode_prompt(tokenizer, p)) for p in held_out]
    eos = eos_token_ids(target, tokenizer)
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    alone = run_target_alone(target, prompts, engine="hf", **common)

    rows = {}
    for schedule in args.schedules:
        for k in ([max(args.draft_lengths)] if schedule == "auto" else args.draft_lengths):
            rows[(k, schedule)] = benchmark(
                target, drafter, prompts, draft_length=k, schedule=schedule,
                max_draft_length=k if schedule == "auto" else None, confidence_threshold=args.confidence_threshold,
                hf_assisted=not args.no_hf_assisted, hf_drafter=hf_drafter, target_outputs=alone, **common)
    defaults = hf_assisted_defaults(target, stored, prompts, **common) if args.hf_defaults else None
    batched = _batched(target, drafter, prompts, args, eos) if args.batch_size > 1 else None
    first = next(iter(rows.values()))
    hf_label = "the same drafter module" if args.hf_drafter == "same" else f"the stored {args.dtype} drafter"
    lines = [f"Target `{args.target}`, drafter `{args.drafter}`, {args.dtype}; our decoder runs the drafter as "
             f"{quantization}, HF assisted generation gets {hf_label}. {len(prompts)} prompts x "
             f"{args.max_new_tokens} tokens, greedy, confidence threshold {args.confidence_threshold}; float32 CPU "
             f"linear layers: {args.cpu_linear}; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
             f"target alone (transformers generate) {first['target_tokens_per_s']:.2f} tokens/s.", "",
             COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
    lines += [_row(k, s, r) for (k, s), r in rows.items()]
    auto = [r for (_, s), r in rows.items() if s == "auto"]
    if auto:
        choice = auto[0]["auto_draft_length"]
        lines += ["", f"auto: K = {choice['best_draft_length']} (calibrated at K = {choice['calibration_draft_length']}"
                  f"); the article's rule of thumb K = accuracy x 5 gives {choice['rule_of_thumb']}."]
    if batched:
        lines += ["", f"batched decoder, batch {batched['batch_size']}, K = {batched['draft_length']}: "
                  f"{batched['tokens_per_s']:.2f} tokens/s over all rows, prefill included (batch 1: "
                  f"{batched['batch1_tokens_per_s']:.2f}), "
                  f"tau {batched['mean_accepted_tokens']:.2f} (batch 1: {batched['batch1_mean_accepted_tokens']:.2f}), "
                  f"identical to batch 1 output: {batched['outputs_match_batch1']}."]
    if defaults:
        lines += ["", f"transformers assisted generation with its defaults ({defaults['settings']}) and the stored "
                  f"drafter: {defaults['tokens_per_s']:.2f} tokens/s, "
                  f"{defaults['tokens_per_s'] / first['target_tokens_per_s']:.2f}x the target alone."]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "benchmark.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                                    "drafter_quantization": quantization, "hf_defaults": defaults,
                                                    "batched": batched,
                                                    "results": {f"{s}/K={k}": r for (k, s), r in rows.items()}})
    write_text_atomic(args.out / "benchmark.md", table)
    _plot(rows, args.out / "speedup_vs_k.png")
    print(json.dumps({"written": str(args.out / "benchmark.json"), "plot": str(args.out / "speedup_vs_k.png")}))


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as error:  # a model not installed, a bad folder: the message says what to do
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
