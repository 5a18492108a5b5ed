"""Measure one target/drafter pair at several draft lengths K, side by side in one run.

    python scripts/sweep_draft_length.py --target qwen2.5-coder-1.5b-instruct \
        --drafter qwen2.5-coder-0.5b-instruct --draft-lengths 1 2 3 4 6 --num-prompts 4 --max-new-tokens 64

Prints a Markdown table (acceptance, tau, tokens/s, speedup, theoretical speedup per K) and writes
it with the raw figures to ``--out`` (JSON + Markdown). The target-alone baseline runs once and
is shared by every K. Figures belong to the torch stack on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decode.benchmark import benchmark, run_target_alone
from distill.models import eos_token_ids, load_model
from distill.prompts import encode_prompt, load_prompts, split_prompts
from distill.rundir import write_json_atomic, write_text_atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct",
                        help="a model name/path, or the drafter/ folder of a distill run")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--source", default="mixed", help="prompt source (humaneval, mtbench, sharegpt, mixed)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("outputs/sweep_draft_length"))
    args = parser.parse_args()
    if min(args.draft_lengths) < 1:
        parser.error("--draft-lengths must all be >= 1")

    target, tokenizer, _ = load_model(args.target, dtype=args.dtype)
    drafter, _, _ = load_model(args.drafter, dtype=args.dtype)
    # the same held-out prompts as the pipeline's evaluate stage (seed 0)
    _, held_out = split_prompts(load_prompts(args.source), num_train=0, num_eval=args.num_prompts, seed=0)
    prompts = [(p.id, p.category, encode_prompt(tokenizer, p)) for p in held_out]
    eos = eos_token_ids(target, tokenizer)
    alone = run_target_alone(target, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos)

    rows = {}
    for k in args.draft_lengths:
        rows[k] = benchmark(target, drafter, prompts, draft_length=k, max_new_tokens=args.max_new_tokens,
                            eos_token_ids=eos, hf_assisted=False, target_outputs=alone)
    lines = [f"Target `{args.target}`, drafter `{args.drafter}`, {args.dtype}, {len(prompts)} prompts x "
             f"{args.max_new_tokens} tokens, greedy.", "",
             "| K | alpha | tau | tokens/s | speedup | c | theoretical | identical |", "|---|---|---|---|---|---|---|---|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['acceptance_rate']:.3f} | {r['mean_accepted_tokens']:.2f} | "
                     f"{r['speculative_tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['cost_ratio']:.3f} | "
                     f"{r['theoretical_speedup']:.2f}x | {r['outputs_match_target']} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "sweep.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": {str(k): v for k, v in rows.items()}})
    write_text_atomic(args.out / "sweep.md", table)
    print(json.dumps({"written": str(args.out / "sweep.json")}))


if __name__ == "__main__":
    main()
