"""How much does the int8 drafter lose against the bf16 one? Agreement and cost, side by side in one run.

    python scripts/drafter_quantization.py --generate outputs/generate/<run> [more runs ...]

The target answers each held-out prompt of the generate runs (``eval_prompts.jsonl``) greedily; each
drafter variant then reads the prompt as the bundled decoder feeds a drafter (all tokens but the last in
one forward, ``decode.model_calls.prefill``, then one token at a time from its KV cache) and is scored
by **top-1 agreement** (its argmax is the target's next token: what greedy speculative decoding accepts
on) per prompt category, with the median cost of a 1-token forward (ms) and of the prompt forward (ms per
prompt). Variants: the drafter in ``--dtype``; torch's own dynamic int8 (weights and activations per
tensor); per-token activations with per-tensor weights; the reverse; draftsmith's int8
(``decode.quantization.quantize_drafter``: per-token activations, per-channel weights). Prints a Markdown
table and writes it with the raw figures to ``--out``. CPU only (int8 dynamic kernels). The docstring of
``decode/quantization.py`` quotes this script's figures.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from decode.model_calls import forward, prefill
from decode.quantization import PerTokenDynamicLinear, quantize_drafter
from decode.speculative import target_generate
from distill.data.generated import load_generated
from distill.data.prompts import encode_prompt
from distill.errors import DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.hardware import auto_dtype
from distill.models.loading import eos_token_ids, load_model


def torch_int8(model, per_token: bool = False, per_channel: bool = False):
    """torch's eager dynamic int8: as it comes (one scale per weight tensor and one per forward's
    activations), with :class:`PerTokenDynamicLinear` (one activation scale per token) and/or with
    one weight scale per output channel."""
    mapping = {torch.nn.Linear: PerTokenDynamicLinear} if per_token else None
    qconfig = (torch.ao.quantization.per_channel_dynamic_qconfig if per_channel
               else torch.ao.quantization.default_dynamic_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).float().eval(), {torch.nn.Linear: qconfig},
                                                      dtype=torch.qint8, mapping=mapping)


@torch.inference_mode()
def score(model, answers: list[dict]) -> dict:
    """Top-1 agreement per category and overall, and the median 1-token / prompt forward cost (ms)."""
    hits: dict[str, list[float]] = {}
    step_ms, prompt_ms = [], []
    for answer in answers:
        start = time.perf_counter()
        cache = prefill(model, torch.tensor([answer["prompt"]]))  # the decoder's own prompt forward
        prompt_ms.append((time.perf_counter() - start) * 1000)
        predicted = []
        for token in answer["prompt"][-1:] + answer["answer"][:-1]:
            start = time.perf_counter()
            logits = forward(model, torch.tensor([[token]]), cache, last_only=True)
            step_ms.append((time.perf_counter() - start) * 1000)
            predicted.append(int(logits.argmax()))
        hits.setdefault(answer["category"], []).extend(float(p == t) for p, t in zip(predicted, answer["answer"]))
    every = [h for values in hits.values() for h in values]
    if not every:
        raise SystemExit("the target answered every prompt with no token: nothing to score")
    return {"agreement": sum(every) / len(every),
            "by_category": {c: sum(v) / len(v) for c, v in sorted(hits.items())},
            "ms_per_token": statistics.median(step_ms), "prompt_ms": statistics.median(prompt_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", nargs="+", required=True, help="finished generate runs; their held-out prompts")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto", help="dtype of target and unquantized drafter (auto: bfloat16 "
                        "where the hardware has bf16 units, else float32)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="outputs/drafter_quantization", help="folder for the .md / .json")
    args = parser.parse_args()
    args.dtype = auto_dtype() if args.dtype == "auto" else args.dtype  # the labels name what ran

    try:
        prompts = [p for run in args.generate for p in load_generated(Path(run))[1]]
    except DraftsmithError as error:  # a wrong folder: say so before any model loads
        parser.error(f"--generate: {error}")
    target, tokenizer, _ = load_model(args.target, dtype=args.dtype)
    eos = eos_token_ids(target, tokenizer)
    answers = []
    for prompt in tqdm(prompts, desc="target answers", unit="prompt"):
        ids = encode_prompt(tokenizer, prompt)
        out = target_generate(target, torch.tensor([ids]), max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
        answers.append({"category": prompt.category, "prompt": ids, "answer": out.new_tokens.flatten().tolist()})
    del target

    drafter, _, _ = load_model(args.drafter, dtype=args.dtype)
    drafter.eval()
    variants = {args.dtype: lambda: drafter, "torch int8 (per-tensor)": lambda: torch_int8(drafter),
                "int8, per-token activations, per-tensor weights": lambda: torch_int8(drafter, per_token=True),
                "int8, per-tensor activations, per-channel weights": lambda: torch_int8(drafter, per_channel=True),
                "draftsmith int8 (per-token, per-channel)": lambda: quantize_drafter(drafter, "int8-dynamic")}
    rows = {}
    for name, make in tqdm(variants.items(), desc="drafter variants", unit="variant"):
        rows[name] = score(make(), answers)
    categories = sorted({c for row in rows.values() for c in row["by_category"]})
    lines = [f"{len(answers)} prompts, {sum(len(a['answer']) for a in answers)} target tokens; drafter "
             f"`{args.drafter}`, target `{args.target}`", "",
             "| drafter | top-1 agreement | " + " | ".join(categories) + " | ms / token | prompt ms |",
             "|---|---|" + "---|" * len(categories) + "---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['agreement']:.3f} | "
                     + " | ".join(f"{row['by_category'].get(c, float('nan')):.3f}" for c in categories)
                     + f" | {row['ms_per_token']:.1f} | {row['prompt_ms']:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "drafter_quantization.md", table)
    write_json_atomic(out / "drafter_quantization.json", {"args": vars(args), "variants": rows})


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as error:  # a model not installed, a bad folder: the message says what to do
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
