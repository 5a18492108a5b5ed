"""evaluate's ``engines``: the tuned and the stock drafter in serving engines, measured and predicted.

For each engine in ``evaluate.engines`` (``vllm``, ``llama_cpp``), on evaluate's timed prompts: the target alone,
the target with each full-vocabulary drafter (the distilled one and the stock one) at draftsmith's recommended K
and at the K the engine's own costs recommend, the engine's acceptance counters, and whether the output equals
the engine's plain greedy output. Before it runs, each speedup is predicted from the drafter's exact per-K tau
(evaluate's simulation on every held-out prompt) and the engine's measured costs
(:func:`decode.engines.prediction.predict_engine_speedups`), so measured / predicted says whether the cost
model holds in that engine.

``report.json`` ``engines``: ``{engine: {"target_tokens_per_s", "speculative_tokens_per_s", "speedup",
"predicted_speedup", "acceptance_rate", "draft_length", "outputs_match_engine_greedy"`` (the distilled
drafter at the first K measured) ``, "drafters": {name: {K: the same figures}}, "costs", "predicted_by_k",
"recommended_draft_length", "version", "verdict"}}``; an engine that fails gets ``{"error": <its message>}``.
"""

from __future__ import annotations

import operator
import shutil
from pathlib import Path
from typing import Any

from decode.engines import ENGINES
from decode.engines.prediction import engine_cost_ratios, predict_engine_speedups
from distill.errors import ConfigError

MAX_K = 8


def check_engines(names: list[str], llama_cpp_bin: str | None) -> None:
    """Refuse, before any model loads, an engine that is unknown or not installed.

    Raises:
        ConfigError: naming the engines draftsmith knows, or the command that installs the missing one.
    """
    from decode.engines.llama_cpp_engine import BUILD, find_tools
    from decode.engines.vllm_engine import VLLM_INSTALL, vllm_installed

    for name in names:
        if name not in ENGINES:
            raise ConfigError(f"evaluate.engines: unknown engine {name!r}; choose from {', '.join(ENGINES)} or "
                              "leave the list empty")
        if name == "vllm" and not vllm_installed():
            raise ConfigError(f"evaluate.engines=[vllm]: vLLM is not installed. Install it with {VLLM_INSTALL} "
                              "(on a GPU node: pip install vllm), or drop vllm from evaluate.engines")
        if name == "llama_cpp" and find_tools(llama_cpp_bin) is None:
            raise ConfigError(f"evaluate.engines=[llama_cpp]: llama.cpp's tools were not found (in "
                              f"evaluate.llama_cpp_bin, $LLAMA_CPP_BIN or PATH). Build them: {BUILD}; or drop "
                              "llama_cpp from evaluate.engines")


def _figures(target: dict[str, Any], run: dict[str, Any], predicted: float | None, same=operator.eq) -> dict[str, Any]:
    counters = run.get("counters", {})
    drafted, accepted = counters.get("spec_decode_num_draft_tokens"), counters.get("spec_decode_num_accepted_tokens")
    matching = sum(same(a, b) for a, b in zip(run["outputs"], target["outputs"]))
    speedup = run["tokens_per_s"] / target["tokens_per_s"]
    return {"target_tokens_per_s": target["tokens_per_s"], "speculative_tokens_per_s": run["tokens_per_s"],
            "speedup": speedup, "predicted_speedup": predicted,
            "measured_over_predicted": speedup / predicted if predicted else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_tokens": 1 + accepted / counters["spec_decode_num_drafts"]
            if counters.get("spec_decode_num_drafts") else None,
            "outputs_match_engine_greedy": matching == len(target["outputs"]),
            "matching_prompts": matching, "num_prompts": len(target["outputs"]), "tokens": run["tokens"],
            "start_s": run.get("start_s")}


def measure_vllm(target_path: Path, drafters: dict[str, Path], per_k: dict[str, dict], prompts: list[list[int]],
                 *, dtype: str, max_new_tokens: int, draft_length: int, progress=print) -> dict[str, Any]:
    """vLLM's section of ``engines``.

    Args:
        target_path: the target's HF folder.
        drafters: ``{name: HF folder}``, full vocabulary; the first is the tuned drafter.
        per_k: ``{name: evaluate's simulated["per_k"]}`` of each drafter.
        prompts: token ids of the timed prompts.
        dtype: the engine's dtype (``float32``, ``bfloat16``).
        max_new_tokens: tokens per answer at most.
        draft_length: draftsmith's recommended K (the torch decoder's).
        progress: where each step is announced (an instance start takes minutes on a CPU).
    """
    from decode.engines.vllm_engine import run_instance

    base = {"dtype": dtype, "prompts": prompts, "max_new_tokens": max_new_tokens}
    progress(f"evaluate: vLLM, the target alone on {len(prompts)} timed prompts and its costs (an engine start "
             "takes 3-5 min on a CPU)")
    target = run_instance({**base, "kind": "plain", "model": str(target_path), "costs": True,
                           "verify_tokens": list(range(1, MAX_K + 2))})
    costs = dict(target["costs"])
    first = next(iter(drafters))
    progress(f"evaluate: vLLM, the drafter {first} alone for its step cost")
    drafter_alone = run_instance({**base, "kind": "plain", "model": str(drafters[first]), "costs": True,
                                  "verify_tokens": [1]})
    costs["drafter_step_s"] = drafter_alone["costs"]["target_step_s"]  # every drafter here has its architecture
    predicted = {name: predict_engine_speedups(per_k[name], costs) for name in drafters}
    engine_best = max(predicted[first], key=predicted[first].get)
    section: dict[str, Any] = {"version": f"vllm {target['version']}", "costs": costs,
                               "cost_ratio": engine_cost_ratios(costs)[0],
                               "predicted_by_k": predicted, "recommended_draft_length": engine_best,
                               "target_alone": {k: target[k] for k in ("tokens_per_s", "tokens", "start_s")},
                               "drafters": {}}
    for name, path in drafters.items():
        for k in dict.fromkeys((draft_length, engine_best)):
            progress(f"evaluate: vLLM, the target with {name} at K = {k} (predicted {_times(predicted[name].get(k))})")
            run = run_instance({**base, "kind": "speculative", "model": str(target_path), "drafter": str(path),
                                "draft_length": k})
            section["drafters"].setdefault(name, {})[str(k)] = _figures(target, run, predicted[name].get(k))
    section.update(section["drafters"][first][str(draft_length)], draft_length=draft_length)
    section["verdict"] = verdict("vLLM", section)
    return section


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def verdict(engine: str, section: dict[str, Any]) -> str:
    """One plain sentence on whether the drafter pays in ``engine``, from the measured speedups."""
    best = max((figures["speedup"], name, k) for name, by_k in section["drafters"].items()
               for k, figures in by_k.items())
    if best[0] < 1.0:
        return f"on this host {engine} is faster without a drafter (best with one: {best[0]:.2f}x, {best[1]} at K = {best[2]})"
    return f"on this host {engine} is {best[0]:.2f}x faster with {best[1]} at K = {best[2]}"


def engines_table(engines: dict[str, Any]) -> list[str]:
    """report.md's table: one row per engine, drafter and K measured."""
    lines = ["| engine | drafter | K | target alone tokens/s | with drafter tokens/s | speedup | predicted | "
             "measured / predicted | acceptance (engine's counters) | output = engine greedy | recommended K |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for engine, section in engines.items():
        if "error" in section:
            lines.append(f"| {engine} | - | - | - | - | - | - | - | - | - | failed: {section['error'].splitlines()[0]} |")
            continue
        for name, by_k in section["drafters"].items():
            for k, f in by_k.items():
                acceptance = "-" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.3f}"
                ratio = "-" if f["measured_over_predicted"] is None else f"{f['measured_over_predicted']:.2f}"
                lines.append(f"| {section['version']} | {name} | {k} | {f['target_tokens_per_s']:.2f} | "
                             f"{f['speculative_tokens_per_s']:.2f} | {f['speedup']:.2f}x | {_times(f['predicted_speedup'])} | "
                             f"{ratio} | {acceptance} | {f['matching_prompts']}/{f['num_prompts']} | "
                             f"{section['recommended_draft_length']} |")
    lines += [""] + [f"- {section.get('verdict', '')}" for section in engines.values() if "verdict" in section]
    return lines


def _ggufs(target_name: str, target_path: Path, drafters: dict[str, Path], folder: Path, progress) -> tuple[Path, dict]:
    """The target as it was shipped (or exported), and every drafter exported alike (q8_0), into ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill.models.gguf import export_gguf
    from distill.models.loading import shipped_gguf

    def exported(path: Path, out: Path) -> Path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        return export_gguf(model, AutoTokenizer.from_pretrained(path), path, out, dtype="q8_0")

    progress(f"evaluate: llama.cpp, GGUFs of the target and of {', '.join(drafters)} (q8_0) in {folder}")
    target = shipped_gguf(target_name, folder / "target.gguf") or exported(target_path, folder / "target.gguf")
    return target, {name: exported(path, folder / f"{name}.gguf") for name, path in drafters.items()}


def measure_llama_cpp(target_name: str, target_path: Path, drafters: dict[str, Path], per_k: dict[str, dict],
                      prompts: list[list[int]], *, max_new_tokens: int, draft_length: int, work_dir: Path,
                      llama_cpp_bin: str | None = None, progress=print) -> dict[str, Any]:
    """llama.cpp's section of ``engines`` (arguments as :func:`measure_vllm`'s; ``work_dir`` holds the GGUFs
    while it runs). The target runs as shipped (its quantized GGUF), both drafters as draftsmith's q8_0 export,
    so they differ only in their weights. K is capped at llama.cpp's default draft length (3) and
    draftsmith's; outputs are compared over the tokens both runs produced (the speculative tool may pass
    max_new_tokens by up to K)."""
    from transformers import AutoTokenizer

    from decode.engines import llama_cpp_engine as llama

    tools = llama.find_tools(llama_cpp_bin)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        target_gguf, ggufs = _ggufs(target_name, target_path, drafters, work_dir, progress)
        depth = sum(map(len, prompts)) // len(prompts)
        progress(f"evaluate: llama.cpp, costs at depth {depth} (llama-bench) and the target alone")
        bench = llama.bench(tools, target_gguf, depth, list(range(1, MAX_K + 2)))
        costs = {"target_step_s": bench["step_s"], "one_token_forward_s": bench["forward_s"][1],
                 "verify_s": bench["forward_s"], "drafter_step_s": llama.bench(tools, next(iter(ggufs.values())),
                                                                               depth, [])["step_s"]}
        alone = [llama.plain(tools, target_gguf, text, max_new_tokens) for text in texts]
        target = {"outputs": [a["text"] for a in alone], "tokens_per_s": _pooled(alone)}
        predicted = {name: predict_engine_speedups(per_k[name], costs) for name in drafters}
        first = next(iter(drafters))
        engine_best = max(predicted[first], key=predicted[first].get)
        section: dict[str, Any] = {"version": llama.version(tools), "costs": costs,
                                   "cost_ratio": engine_cost_ratios(costs)[0], "predicted_by_k": predicted,
                                   "recommended_draft_length": engine_best,
                                   "target_alone": {"tokens_per_s": target["tokens_per_s"]},
                                   "drafters": {}}
        for name, gguf in ggufs.items():
            for k in dict.fromkeys((draft_length, 3, engine_best)):
                progress(f"evaluate: llama.cpp, the target with {name} at K = {k} "
                         f"(predicted {_times(predicted[name].get(k))})")
                runs = [llama.speculative(tools, target_gguf, gguf, text, max_new_tokens, k) for text in texts]
                run = {"outputs": [r["text"] for r in runs], "tokens_per_s": _pooled(runs),
                       "tokens": sum(r["tokens"] for r in runs),
                       "counters": {"spec_decode_num_drafts": None,
                                    "spec_decode_num_draft_tokens": sum(r["drafted"] for r in runs),
                                    "spec_decode_num_accepted_tokens": sum(r["accepted"] for r in runs)}}
                figures = _figures(target, run, predicted[name].get(k), same=_same_text)
                section["drafters"].setdefault(name, {})[str(k)] = figures
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    section.update(section["drafters"][first][str(draft_length)], draft_length=draft_length)
    section["verdict"] = verdict("llama.cpp", section)
    return section


def _pooled(runs: list[dict[str, Any]]) -> float:
    """Tokens/s over all runs: total tokens over total seconds."""
    return sum(r["tokens"] for r in runs) / sum(r["tokens"] / r["tokens_per_s"] for r in runs)


def _same_text(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def measure_engine(name: str, target_name: str, target_path: Path, drafters: dict[str, Path],
                   per_k: dict[str, dict], prompts: list[list[int]], *, dtype: str, max_new_tokens: int,
                   draft_length: int, work_dir: Path, llama_cpp_bin: str | None = None,
                   progress=print) -> dict[str, Any]:
    """One engine's section of ``engines`` (arguments as :func:`measure_vllm`'s and :func:`measure_llama_cpp`'s).

    Raises:
        RuntimeError: the engine failed (its message ends with the engine's last output lines).
    """
    if name == "vllm":
        return measure_vllm(target_path, drafters, per_k, prompts, dtype=dtype, max_new_tokens=max_new_tokens,
                            draft_length=draft_length, progress=progress)
    return measure_llama_cpp(target_name, target_path, drafters, per_k, prompts, max_new_tokens=max_new_tokens,
                             draft_length=draft_length, work_dir=work_dir, llama_cpp_bin=llama_cpp_bin,
                             progress=progress)
