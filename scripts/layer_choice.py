"""Which decoder layers should a depth-pruned drafter keep? Score candidate layer lists before training.

    python scripts/layer_choice.py --generate outputs/generate/<run> \
        --layers 0,1,2,3 0,1,22,23 0,1,2,15,16,17,18,19,20,21,22,23 --even 4 12

For each candidate it cuts the drafter's base model (``distill.drafters.build.cut_layers``, untrained) and scores
it with ``distill.training.loop.validate`` on the first ``--num-examples`` answers of a generate run that stored the
target's top-k log-probabilities (``generate.store_top_k``): teacher-forced **top-1 agreement** (the
drafter's argmax is the target's: what greedy decoding accepts on), 1 - TV on the stored top-k (an upper
bound) and the loss. Prints a Markdown table, best agreement first, and writes it with the raw figures to
``--out``. No target is loaded. RESULTS.md's layer table comes from this script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distill.data.generated import load_generated
from distill.drafters.build import cut_layers, describe_layers, select_layers
from distill.errors import DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.models.loading import load_model
from distill.training.loop import validate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", required=True, help="a finished generate run made with generate.store_top_k")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", help="base model the layers come from")
    parser.add_argument("--layers", nargs="*", default=[], help="comma-separated layer lists, e.g. 0,1,2,22,23")
    parser.add_argument("--first", nargs="*", type=int, default=[], help="also the first N layers, for each N")
    parser.add_argument("--even", nargs="*", type=int, default=[], help="also N evenly spaced layers, for each N")
    parser.add_argument("--num-examples", type=int, default=24, help="answers scored (the first of the dataset)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="auto", help="drafter dtype (auto, as drafters decode by default)")
    parser.add_argument("--out", default="outputs/layer_choice", help="folder for layer_choice.md / .json")
    args = parser.parse_args()

    try:
        dataset, _, manifest = load_generated(Path(args.generate))
    except DraftsmithError as error:  # a wrong folder: say so before any model loads
        parser.error(f"--generate: {error}")
    if not manifest.get("store_top_k"):
        parser.error(f"{args.generate} holds no stored target log-probs: generate with generate.store_top_k=20")
    columns = ["prompt_ids", "completion_ids", "top_k_ids", "top_k_logprobs"]
    examples = [{c: row[c] for c in columns}
                for row in dataset.select(range(min(args.num_examples, len(dataset)))).select_columns(columns)]
    base, _, _ = load_model(args.drafter, dtype=args.dtype)
    total = base.config.num_hidden_layers
    candidates = [[int(i) for i in text.split(",")] for text in args.layers]
    candidates += [select_layers(total, n, "first") for n in args.first]
    candidates += [select_layers(total, n, "even") for n in args.even]
    if not candidates:
        parser.error("give at least one candidate: --layers, --first or --even")

    rows = []
    for keep in candidates:
        if keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= total:
            parser.error(f"--layers {keep}: ascending, unique indices in 0..{total - 1}")
        figures = validate(base if keep == list(range(total)) else cut_layers(base, keep), None, examples,
                           max_seq_len=args.max_seq_len)
        rows.append({"layers": keep, "label": describe_layers(len(keep), "first", keep), **figures})
        print(f"{rows[-1]['label']}: top-1 agreement {figures['top1_agreement']:.3f}", flush=True)
    rows.sort(key=lambda r: -r["top1_agreement"])

    lines = [f"# Layer choice: {args.drafter}, untrained, {len(examples)} answers of {args.generate}", "",
             "| layers kept | count | top-1 agreement | 1 - TV (stored top-k, upper bound) | loss (nats/token) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {len(r['layers'])} | {r['top1_agreement']:.3f} | {r['expected_acceptance']:.3f} "
              f"| {r['loss']:.3f} |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "layer_choice.md", "\n".join(lines) + "\n")
    write_json_atomic(out / "layer_choice.json", {"drafter": args.drafter, "generate": args.generate, "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as error:  # a model not installed, a bad folder: the message says what to do
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
