"""Each stage's rate on this host beside the bound the hardware sets, measured in the same run.

    python scripts/benchmark_stages.py                 # the shipped pair, 12 ShareGPT prompts, a table
    python scripts/benchmark_stages.py --json          # the figures as JSON (scripts read these names)
    python scripts/benchmark_stages.py --stages score,distill --prompts 32

Stages and their bounds:

* ``generate``: the target writes answers (``distill.stages.generate.answer_batch``, generate's default
  batching, top-20 log-probs kept); ``score``: the target scores the prompts' existing answers
  (``distill.data.scoring.score_batch``). Both count every token they process (prompt and answer) per second,
  against the bound: the target's forward over many tokens (``--bound-rows`` x ``--bound-len`` random tokens,
  no cache, the best of two timed forwards after a warm-up).
* ``distill``: distillation on the scored examples' stored top-k (``distill.training.loop.train_drafter``) with
  the recipe of ``--distill`` (a ``conf/distill`` group; default the pipeline's, ``full_low_lr``: a full fine-tune
  with the embeddings and head frozen; ``lora`` for DistillConfig's LoRA r16), the recipe's examples per optimizer
  step in one micro-batch, packed as ``distill.packing`` says unless ``--packing`` forces a mode; real tokens
  (prompt + answer, no padding) per second of optimizer step, against the bound: the drafter's dense forward + backward (every weight
  trainable, a cross-entropy on every position) over the same number of rows and tokens.

``ratio`` = stage tokens/s / bound tokens/s. Speed goals live here as ratios, never as wall-clock limits; run
it on an otherwise idle machine (each stage's time is its own, one after the other).

JSON: ``{"generate": {"tokens_per_s", "answer_tokens_per_s", "bound_tokens_per_s", "ratio", "tokens",
"seconds"}, "score": {...}, "distill": {...}, "host": {...}, "settings": {...}}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing_throughput import run_mode  # noqa: E402  (a sibling script: one LoRA training run, its step figures)

from decode.cpu_linear import use_onednn_linear  # noqa: E402
from decode.teacher_forcing import batches_by_length  # noqa: E402
from distill.config import DistillConfig, GenerateConfig  # noqa: E402
from distill.data.prompts import encode_prompt, load_prompts  # noqa: E402
from distill.data.scoring import encode_answer, score_batch  # noqa: E402
from distill.errors import DraftsmithError  # noqa: E402
from distill.hardware import auto_dtype, bf16_is_fast, process_device, release_memory  # noqa: E402
from distill.models.loading import eos_token_ids, load_model  # noqa: E402
from distill.stages.generate import answer_batch  # noqa: E402

STAGES = ("generate", "score", "distill")
CONF = Path(__file__).resolve().parent.parent / "conf"
DEFAULT_RECIPE = "full_low_lr"  # conf/config.yaml's distill group


def timed(fn) -> tuple[object, float]:
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.inference_mode()
def forward_bound(model, rows: int, length: int) -> float:
    """The target's tokens/s over ``rows x length`` random tokens in one forward (no cache, full logits): the
    best of two after a small warm-up."""
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (rows, length), device=model.device)
    model(input_ids=ids[:1, :32], use_cache=False)
    return max(rows * length / timed(lambda: model(input_ids=ids, use_cache=False))[1] for _ in range(2))


def train_bound(model, rows: int, length: int) -> float:
    """The drafter's tokens/s of a dense forward + backward (every weight trainable, cross-entropy on every
    position) over ``rows x length`` random tokens: the best of two after a warm-up."""
    model = copy.deepcopy(model).train()
    for p in model.parameters():
        p.requires_grad_(True)
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (rows, length), device=model.device)

    def step(batch):
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step(ids[:1, :32])
    best = max(rows * length / timed(lambda: step(ids))[1] for _ in range(2))
    del model
    release_memory()
    return best


def stage_figures(tokens: int, answer_tokens: int, seconds: float, bound: float) -> dict:
    """One stage's row: every token it processed per second, answer tokens per second, the bound, the ratio."""
    rate = tokens / seconds
    return {"tokens_per_s": round(rate, 2), "answer_tokens_per_s": round(answer_tokens / seconds, 2),
            "bound_tokens_per_s": round(bound, 2), "ratio": round(rate / bound, 3), "tokens": tokens,
            "seconds": round(seconds, 2)}


def measure_generate(target, prompts: list[list[int]], eos: list[int], pad: int, g: GenerateConfig, bound: float):
    """generate's rows for ``prompts`` (generate's batching and settings): its figures and the answers."""
    answers: list = [None] * len(prompts)

    def run():
        for rows in batches_by_length([len(p) for p in prompts], g.batch_tokens, g.batch_size):
            out = answer_batch(target, [prompts[i] for i in rows], pad_id=pad, eos_ids=eos, max_new_tokens=g.max_new_tokens,
                               temperature=g.temperature, top_p=g.top_p, store_top_k=g.store_top_k)
            for i, row in zip(rows, out):
                answers[i] = row

    _, seconds = timed(run)
    new = sum(len(a["completion_ids"]) for a in answers)
    return stage_figures(sum(map(len, prompts)) + new, new, seconds, bound)


def measure_generate_vllm(path: Path, dtype: str, prompts: list[list[int]], eos: list[int], g: GenerateConfig,
                          bound: float) -> dict:
    """generate's rows for ``prompts`` from vLLM (``generate.engine=vllm``), every prompt in one call; its start
    (load and compile) is reported as ``start_seconds``, outside the rate."""
    from distill.data.vllm_answers import VllmAnswerer

    engine, start_s = timed(lambda: VllmAnswerer(path, dtype=dtype, max_model_len=max(map(len, prompts)) + g.max_new_tokens,
                                                 max_num_seqs=g.batch_size, store_top_k=g.store_top_k, seed=0))
    try:
        answers, seconds = timed(lambda: engine.answer(prompts, list(range(len(prompts))), eos_ids=eos,
                                                       max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                                       top_p=g.top_p))
    finally:
        engine.close()
    new = sum(len(a["completion_ids"]) for a in answers)
    return {**stage_figures(sum(map(len, prompts)) + new, new, seconds, bound), "engine": "vllm",
            "start_seconds": round(start_s, 1)}


def measure_score(target, prompts: list[list[int]], given: list[tuple[list[int], str]], g: GenerateConfig,
                  bound: float) -> tuple[dict, list[dict]]:
    """Scoring ``given`` answers (generate's batching over prompt + answer lengths): figures and the examples."""
    examples: list = [None] * len(prompts)

    def run():
        lengths = [len(p) + len(a) for p, (a, _) in zip(prompts, given)]
        for rows in batches_by_length(lengths, g.batch_tokens, g.batch_size):
            out = score_batch(target, [prompts[i] for i in rows], [given[i] for i in rows], store_top_k=g.store_top_k)
            for i, row in zip(rows, out):
                examples[i] = {"prompt_ids": prompts[i], **row}

    _, seconds = timed(run)
    new = sum(len(a) for a, _ in given)
    return stage_figures(sum(map(len, prompts)) + new, new, seconds, bound), examples


def distill_recipe(group: str) -> DistillConfig:
    """``conf/distill/<group>.yaml`` over DistillConfig's defaults, as the pipeline resolves it.

    Raises:
        DraftsmithError: no such group file, or a method other than lora and full.
    """
    path = CONF / "distill" / f"{group}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise DraftsmithError(f"--distill {group}: no {path}; one of {', '.join(names)}")
    recipe = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DistillConfig), OmegaConf.load(path)))
    if recipe.method not in ("lora", "full"):
        raise DraftsmithError(f"--distill {group}: method {recipe.method} is not benchmarked (lora or full)")
    return recipe


def measure_distill(drafter, examples: list[dict], args) -> dict:
    """Distillation on ``examples`` (stored top-k) with the ``--distill`` recipe (its method, LoRA rank and
    examples per optimizer step, one micro-batch a step) against the drafter's dense forward + backward over as
    many rows and tokens as a micro-batch holds."""
    d = distill_recipe(args.distill)
    rows = d.batch_size * d.grad_accum  # the recipe's examples per optimizer step, in one micro-batch
    packed = d.packing is not False if args.packing == "default" else args.packing == "packed"  # Qwen2 allows it
    settings = argparse.Namespace(lora_r=d.lora_r if d.method == "lora" else None, warmup_steps=1, steps=args.steps,
                                  batch_size=rows, max_seq_len=d.max_seq_len, mixed_precision=d.mixed_precision,
                                  seed=0)
    with tempfile.TemporaryDirectory(prefix="benchmark_stages-") as tmp:
        sums = run_mode(drafter, None, examples, settings, packed=packed, folder=Path(tmp))
    row_len = max(16, round(sums["real"] / (sums["steps"] * rows)))
    bound = train_bound(drafter, rows, row_len)
    return {**stage_figures(sums["real"], sums["completion"], sums["seconds"], bound), "packing": packed,
            "recipe": args.distill, "method": d.method, "density": round(sums["density"], 3),
            "bound_shape": [rows, row_len]}


def sharegpt_with_answers(tokenizer, eos: list[int], count: int, max_prompt_tokens: int, max_new: int):
    """The first ``count`` ShareGPT prompts with an answer and at most ``max_prompt_tokens`` tokens: their ids and
    their encoded answers."""
    prompts, given = [], []
    for p in load_prompts("sharegpt", limit=count * 4):
        ids = encode_prompt(tokenizer, p)
        if p.answer and len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            given.append(encode_answer(tokenizer, p, eos, max_new))
        if len(prompts) == count:
            break
    return prompts, given


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto", help="the target's dtype (auto: bf16 with bf16 units)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of " + ", ".join(STAGES))
    parser.add_argument("--prompts", type=int, default=12, help="ShareGPT prompts (with their answers)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens per prompt, at most")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="timed distill steps (after one untimed)")
    parser.add_argument("--bound-rows", type=int, default=2)
    parser.add_argument("--bound-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=GenerateConfig.batch_size,
                        help="generate.batch_size for generate and score (with --engine vllm: sequences together)")
    parser.add_argument("--batch-tokens", type=int, default=GenerateConfig.batch_tokens, help="generate.batch_tokens")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="generate's engine (vllm: installed as docs/runs.md says; its start is reported, not timed)")
    parser.add_argument("--distill", default=DEFAULT_RECIPE,
                        help="the distill recipe: a conf/distill group (default: the pipeline's, full_low_lr)")
    parser.add_argument("--packing", choices=("default", "packed", "padded"), default="default",
                        help="distill's micro-batches: as distill.packing's default, or forced")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args()
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or set(stages) - set(STAGES):
        parser.error(f"--stages: a comma-separated list of {', '.join(STAGES)}")
    if "distill" in stages:
        distill_recipe(args.distill)  # a bad group is refused before any model loads
    if "distill" in stages and "score" not in stages:
        stages.insert(0, "score")  # distill trains on the scored examples
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    result: dict = {"host": {"bf16_units": bf16_is_fast(), "target_dtype": dtype, "threads": torch.get_num_threads(),
                             "cpu": platform.processor() or platform.machine(), "cuda": torch.cuda.is_available()},
                    "settings": vars(args)}
    g = GenerateConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, batch_tokens=args.batch_tokens)
    target, tokenizer, resolved = load_model(args.target, dtype=dtype)
    target = target.to(process_device())
    use_onednn_linear(target)  # as generate runs it
    eos = eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts, given = sharegpt_with_answers(tokenizer, eos, args.prompts, args.max_prompt_tokens, args.max_new_tokens)
    bound = forward_bound(target, args.bound_rows, args.bound_len)
    result["host"]["target_forward_tokens_per_s"] = round(bound, 2)
    if "score" in stages:
        result["score"], examples = measure_score(target, prompts, given, g, bound)
    if "generate" in stages and args.engine == "hf":
        result["generate"] = measure_generate(target, prompts, eos, pad, g, bound)
    del target
    release_memory()
    if "generate" in stages and args.engine == "vllm":
        result["generate"] = measure_generate_vllm(resolved.path, dtype, prompts, eos, g, bound)
    if "distill" in stages:
        drafter = load_model(args.drafter, dtype="float32")[0].to(process_device())
        result["distill"] = measure_distill(drafter, examples, args)
    print(json.dumps(result, indent=2) if args.json else render(result))


def render(result: dict) -> str:
    """A Markdown table: each stage's tokens/s, answer tokens/s, bound and ratio, and the host."""
    host = result["host"]
    lines = [f"host: {host['cpu']}, {'bf16 units' if host['bf16_units'] else 'no bf16 units (AVX2)'}, target "
             f"{host['target_dtype']}, {host['threads']} threads", "",
             "| stage | tokens/s (prompt + answer) | answer tokens/s | bound tokens/s | ratio |", "|---|---|---|---|---|"]
    bounds = {"generate": "target forward", "score": "target forward", "distill": "drafter forward + backward"}
    for stage in STAGES:
        if stage in result:
            r = result[stage]
            label = f"{stage} ({r['recipe']})" if "recipe" in r else stage
            lines.append(f"| {label} | {r['tokens_per_s']:.1f} | {r['answer_tokens_per_s']:.1f} | "
                         f"{r['bound_tokens_per_s']:.1f} ({bounds[stage]}) | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except DraftsmithError as error:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {error}")
