"""evaluate's exact acceptance: the target answers every held-out prompt once, each drafter is teacher-forced
over those answers, and ``decode.acceptance`` replays the decoder's blocks (see its docstring).

The timed decoder runs on a few of the prompts only (``evaluate.timed_prompts``); it gives c and the
verification costs that turn simulated tau into a predicted speedup, and ``simulation_check`` compares its
blocks with the simulation's on the decoder's own output.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from decode.acceptance import (
    BlockTotals,
    DrafterCosts,
    SimulationSettings,
    TeacherForced,
    block_totals,
    drafter_costs,
    paired_speedup_ratio,
    paired_tau_difference,
    simulate,
    simulated_section,
)
from decode.prompt_lookup import DEFAULT_MAX_NGRAM
from decode.stopping import StopStrings
from decode.teacher_forcing import (
    drafter_predictions,
    head_on_body_is_forward,
    same_body,
    sampling_betas,
    shared_body_predictions,
    target_answers,
)
from distill import parallel
from distill.files import write_json_atomic

Prompts = list[tuple[str, str, list[int]]]  # (prompt_id, category, token ids)


def settings_of(decode_cfg, timed: dict[str, Any]) -> SimulationSettings:
    """The simulated decoder settings: the config's, at the K the timed run used (``schedule=auto`` chose one)."""
    sampling = decode_cfg.temperature > 0
    # auto ran a constant K; speculative sampling is simulated for a constant K without a threshold only
    constant = decode_cfg.schedule == "auto" or sampling
    return SimulationSettings(draft_length=int(timed.get("draft_length") or decode_cfg.draft_length),
                              max_new_tokens=decode_cfg.max_new_tokens,
                              schedule="constant" if constant else decode_cfg.schedule,
                              max_draft_length=None if constant else decode_cfg.max_draft_length,
                              confidence_threshold=0.0 if sampling else decode_cfg.confidence_threshold,
                              sampling=sampling)


def answers_target_key(fingerprint: str, dtype_setting: str, model) -> str:
    """What identifies the target in an answers cache key: its fingerprint, the ``target.dtype`` setting and
    the dtype that setting became (``auto`` differs between hosts)."""
    return f"{fingerprint}/{dtype_setting}/{str(next(model.parameters()).dtype).replace('torch.', '')}"


def answer_all(target, prompts: Prompts, decode_cfg, *, eos: list[int], pad_id: int, batch_size: int, seed: int,
               batch_tokens: int | None = None, cache_dir: Path | None = None, target_key: str = "", tokenizer=None,
               look_in: tuple[Path, ...] = (), who: str = "evaluate") -> list[list[int]]:
    """The target's answers to every prompt, as the decoder would emit them (greedy, or sampled with ``seed``),
    each cut after the token completing one of ``decode.stop_strings`` (needs ``tokenizer``) as the decoder cuts.

    With ``cache_dir``, answers are kept in ``cache_dir/answers-<key>.json`` (written atomically), the key
    covering ``target_key`` (see :func:`answers_target_key`), the decode settings, the batching
    (``batch_size`` rows and at most ``batch_tokens`` padded prompt tokens a batch) and the prompts' token ids: generate answers its held-out prompts into its run folder, and every evaluate of a
    sweep on that held-out set reads them there (``look_in``) or answers once into ``cache_dir``. Of N launched
    processes each answers every N-th batch, all get the whole list, and the main one writes the file.
    """
    def key_for(batching: tuple[int, int | None]) -> str:
        return answers_key(target, prompts, decode_cfg, eos=eos, batch_size=batching[0], seed=seed,
                           target_key=target_key, batch_tokens=batching[1])

    key = key_for((batch_size, batch_tokens))
    # a run folder's answers were batched as its own config says: looked up under that batching as well, so that
    # evaluating with other generate.batch_* settings does not answer the held-out prompts again
    candidates = [(Path(folder), name) for folder in look_in
                  for name in dict.fromkeys(answers_file(key_for(b)) for b in
                                            ((batch_size, batch_tokens), *recorded_batching(Path(folder))))]
    candidates += [(Path(cache_dir), answers_file(key))] if cache_dir else []
    for folder, name in candidates:
        cached = _cached_answers(folder / name, len(prompts))
        if cached is not None:
            print(f"{who}: the target's answers to these {len(prompts)} prompts come from {folder / name}")
            return cached
    if any(any(Path(folder).glob("answers-*.json")) for folder in look_in):
        print(f"{who}: no answers file in {', '.join(map(str, look_in))} matches these prompts and settings (decode.*, "
              f"evaluate.seed, the target and its dtype): the target answers the {len(prompts)} prompts now")
    answers = parallel.merged_parts(target_answers(  # of N launched processes (generate), each answers 1/N
        target, [ids for _, _, ids in prompts], max_new_tokens=decode_cfg.max_new_tokens, eos_token_ids=eos,
        pad_token_id=pad_id, batch_size=batch_size, temperature=decode_cfg.temperature, top_k=decode_cfg.top_k,
        top_p=decode_cfg.top_p, seed=seed, batch_tokens=batch_tokens, part=parallel.rank_and_size()))
    stopper = StopStrings(list(decode_cfg.stop_strings), tokenizer)
    if stopper:
        for i, answer in enumerate(answers):
            stop = stopper.first_stop(answer, 0)
            answers[i] = answer if stop is None else answer[:stop + 1]
    if cache_dir is not None and parallel.is_main():
        write_json_atomic(Path(cache_dir) / answers_file(key), answers)
    return answers


def answers_key(target, prompts: Prompts, decode_cfg, *, eos: list[int], batch_size: int, seed: int,
                target_key: str, batch_tokens: int | None = None) -> str:
    """The cache key of :func:`answer_all`'s answers (16 hex digits)."""
    settings = (decode_cfg.max_new_tokens, decode_cfg.temperature, decode_cfg.top_k, decode_cfg.top_p, seed,
                batch_size, batch_tokens, list(eos), list(decode_cfg.stop_strings),  # batching changes the rounding: the answers too
                str(target.device), torch.__version__)
    return hashlib.sha256(json.dumps([target_key, settings, [ids for _, _, ids in prompts]]).encode()).hexdigest()[:16]


def recorded_batching(run: Path) -> list[tuple[int, int | None]]:
    """The ``(generate.batch_size, generate.batch_tokens)`` a run folder's ``config.yaml`` records, as a list of
    at most one: empty when the file or the settings are absent or unreadable."""
    try:
        g = yaml.safe_load((run / "config.yaml").read_text())["generate"]
        return [(int(g["batch_size"]), None if g.get("batch_tokens") is None else int(g["batch_tokens"]))]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return []


def answers_file(key: str) -> str:
    """The answers file's name for ``key``."""
    return f"answers-{key}.json"


def _cached_answers(path: Path, count: int) -> list[list[int]] | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or unreadable: answered again (and rewritten)
    return cached if isinstance(cached, list) and len(cached) == count else None


def teacher_forced(target, drafter, prompts: Prompts, answers: list[list[int]], decode_cfg,
                   vocab: int) -> list[TeacherForced]:
    """One drafter's teacher-forced pass over the target's answers (betas too when sampling). Of N launched
    processes each computes every N-th batch; all get the whole list."""
    prompt_ids, part = [ids for _, _, ids in prompts], parallel.rank_and_size()
    if decode_cfg.temperature > 0:  # sampling needs the betas only
        betas = parallel.merged_parts(sampling_betas(
            target, drafter, prompt_ids, answers, temperature=decode_cfg.temperature, top_k=decode_cfg.top_k,
            top_p=decode_cfg.top_p, part=part))
        predictions = [([], None)] * len(prompts)
    else:
        predictions = parallel.merged_parts(drafter_predictions(drafter, prompt_ids, answers, vocab_size=vocab,
                                                                part=part))
        betas = [None] * len(prompts)
    return [TeacherForced(pid, category, ids, answer, tokens, probs, beta)
            for (pid, category, ids), answer, (tokens, probs), beta in zip(prompts, answers, predictions, betas)]


def shared_body_groups(drafters: dict[str, Any]) -> list[list[str]]:
    """The keys of ``drafters`` grouped by equal decoder layers (:func:`decode.teacher_forcing.same_body`), in
    their order: the stock drafter and its untrained reduced heads fall in one group. A drafter whose logits are
    more than its head on those layers (:func:`decode.teacher_forcing.head_on_body_is_forward`) stays alone."""
    sharing = {key: head_on_body_is_forward(drafter) for key, drafter in drafters.items()}
    groups: list[list[str]] = []
    for key, drafter in drafters.items():
        group = next((g for g in groups if sharing[key] and sharing[g[0]] and same_body(drafters[g[0]], drafter)),
                     None)
        if group is None:
            groups.append([key])
        else:
            group.append(key)
    return groups


def teacher_forced_shared(drafters: dict[str, Any], prompts: Prompts, answers: list[list[int]],
                          vocab: int) -> dict[str, list[TeacherForced]]:
    """Greedy :func:`teacher_forced` of drafters that share their decoder layers (one group of
    :func:`shared_body_groups`), the layers run once for all; keyed as ``drafters``. Of N launched processes
    each computes every N-th batch; all get the whole lists."""
    prompt_ids, keys = [ids for _, _, ids in prompts], list(drafters)
    per_drafter = shared_body_predictions([drafters[k] for k in keys], prompt_ids, answers, vocab_size=vocab,
                                          part=parallel.rank_and_size())
    result = {}
    for key, predictions in zip(keys, per_drafter):
        predictions = parallel.merged_parts(predictions)
        result[key] = [TeacherForced(pid, category, ids, answer, tokens, probs)
                       for (pid, category, ids), answer, (tokens, probs) in zip(prompts, answers, predictions)]
    return result


def simulated_drafter(samples: list[TeacherForced], settings: SimulationSettings, timed: dict[str, Any],
                      seed: int) -> tuple[dict, list]:
    """``simulated`` of one model drafter, predicted speedups from its timed run's c and verification costs
    (``timed``: ``cost_ratio``, ``verify_costs`` and the timing rounds behind them, ``cost_ratio_rounds`` and
    ``verify_cost_rounds``, which the intervals resample)."""
    return simulated_section(samples, settings, cost_ratio=timed.get("cost_ratio"),
                             verify_costs=timed.get("verify_costs"), seed=seed,
                             cost_ratio_rounds=timed.get("cost_ratio_rounds") or (),
                             verify_cost_rounds=timed.get("verify_cost_rounds") or ())


@dataclass
class Pairing:
    """One model drafter's per-prompt simulated totals, kept to pair it with another drafter on the same prompts.

    Attributes:
        at_k: totals at the run's K (``decode.draft_length``), for the paired tau difference.
        best_k: its recommended K (highest predicted speedup); None without measured costs.
        at_best_k: totals at ``best_k``; ``best_costs``: c and the verification cost there.
    """

    at_k: list[BlockTotals]
    best_k: int | None = None
    at_best_k: list[BlockTotals] | None = None
    best_costs: DrafterCosts | None = None


def pairing_of(samples: list[TeacherForced], settings: SimulationSettings, section: dict[str, Any],
               totals: list[BlockTotals], timed: dict[str, Any]) -> Pairing:
    """The :class:`Pairing` of a drafter whose ``simulated`` section is ``section`` (``totals`` at the run's
    K) and whose costs come from ``timed`` (``cost_ratio``, ``verify_costs`` and their rounds)."""
    best, c = section.get("recommended_draft_length"), timed.get("cost_ratio")
    if best is None or c is None:
        return Pairing(totals)
    at_best = totals if best == settings.draft_length and settings.schedule == "constant" else \
        block_totals(samples, settings, draft_length=best)
    return Pairing(totals, best, at_best, drafter_costs(c, timed.get("verify_costs"), best,
                                                        cost_ratio_rounds=timed.get("cost_ratio_rounds") or (),
                                                        verify_cost_rounds=timed.get("verify_cost_rounds") or ()))


def paired_against(a: Pairing, b: Pairing, seed: int) -> dict[str, Any]:
    """Drafter a against drafter b on the same prompts: the tau difference at the run's K and, with costs, the
    ratio of predicted speedups each at its own best K, both with paired 95% bootstrap intervals."""
    result: dict[str, Any] = {"tau_difference": paired_tau_difference(a.at_k, b.at_k, seed=seed)}
    if a.best_costs and b.best_costs:
        result["predicted_speedup_ratio"] = {
            **paired_speedup_ratio(a.at_best_k, a.best_costs, b.at_best_k, b.best_costs, seed=seed),
            "draft_lengths": [a.best_k, b.best_k], "cost_ratios": [a.best_costs.cost_ratio, b.best_costs.cost_ratio]}
    return result


def ratio_with_costs(a: Pairing, b: Pairing, cost_ratios: tuple[float, float], seed: int) -> dict[str, Any] | None:
    """The predicted-speedup ratio of a over b at the same K and verification costs as :func:`paired_against`
    but with other c (``cost_ratios``: a's, b's; e.g. estimated from shapes where timing was disturbed), the
    interval over prompts alone; None where either has no costs."""
    if not (a.best_costs and b.best_costs) or None in cost_ratios:
        return None
    costs_a = DrafterCosts(cost_ratios[0], a.best_costs.verify_cost)
    costs_b = DrafterCosts(cost_ratios[1], b.best_costs.verify_cost)
    result = paired_speedup_ratio(a.at_best_k, costs_a, b.at_best_k, costs_b, seed=seed)
    return {"ratio": result["ratio"], "ci95": result["ci95"], "cost_ratios": list(cost_ratios),
            "draft_lengths": [a.best_k, b.best_k]}


def simulated_choice(section: dict[str, Any], timed_choice: dict[str, Any] | None) -> dict[str, Any] | None:
    """``draft_length_choice`` from the simulated tau at every K (``section["per_k"]``) and the measured costs,
    in place of the timed run's, which extrapolates past the positions its few prompts drafted; the timed
    run's pick is kept as ``timed_best_draft_length``. None when the section has no per-K figures."""
    per_k = (section or {}).get("per_k") or {}
    by_k = {int(k): v["predicted_speedup"] for k, v in per_k.items() if v.get("predicted_speedup") is not None}
    if not by_k:
        return timed_choice
    timed_choice = timed_choice or {}
    best = section.get("recommended_draft_length") or max(by_k, key=lambda k: (by_k[k], -k))
    return {"best_draft_length": int(best), "expected_speedup_by_k": by_k,
            "rule_of_thumb": timed_choice.get("rule_of_thumb"), "cost_ratio": timed_choice.get("cost_ratio"),
            "verify_costs": timed_choice.get("verify_costs"), "speculation_pays": max(by_k.values()) > 1.0,
            "source": f"simulated on {section.get('num_prompts')} prompts",
            "timed_best_draft_length": timed_choice.get("best_draft_length")}


def prompt_lookup_section(prompts: Prompts, answers: list[list[int]], settings: SimulationSettings,
                          verify_costs, seed: int) -> dict | None:
    """``baselines.prompt_lookup`` (greedy only): simulated, with drafting taken as free (c = 0)."""
    if settings.sampling:
        return None
    samples = [TeacherForced(pid, category, ids, answer, []) for (pid, category, ids), answer in zip(prompts, answers)]
    section, _ = simulated_section(samples, settings, cost_ratio=0.0, verify_costs=verify_costs,
                                   lookup_ngram=DEFAULT_MAX_NGRAM, seed=seed)
    return {"max_ngram": DEFAULT_MAX_NGRAM, "simulated": section,
            "note": "transformers' prompt_lookup_num_tokens rule; drafting cost not counted (c = 0)"}


def simulation_check(drafter, timed: dict[str, Any], prompts: Prompts, settings: SimulationSettings,
                     vocab: int) -> dict | None:
    """The simulated blocks on the timed decoder's own output tokens against its blocks, per prompt.

    ``identical_blocks`` counts each prompt's leading blocks that agree (after a difference the two are out
    of step); ``identical_prompts`` the prompts whose blocks all agree; ``accepted_tokens`` and ``num_blocks``
    give both sides' totals ``[simulated, decoded]``. Greedy only (None for sampling, where blocks are random).
    """
    if settings.sampling:
        return None
    per_prompt = {p["prompt_id"]: p for p in timed.get("per_prompt", [])}
    timed_prompts = [p for p in prompts if p[0] in per_prompt]
    if not timed_prompts:
        return None
    outputs = [per_prompt[pid]["output_ids"] for pid, _, _ in timed_prompts]
    samples = teacher_forced_greedy(drafter, timed_prompts, outputs, vocab)
    blocks = identical = same_prompts = 0
    accepted, num_blocks = [0, 0], [0, 0]
    for sample, result in zip(samples, simulate(samples, settings)):
        decoded, simulated = per_prompt[sample.prompt_id]["accepted_per_block"], result.accepted_per_block
        blocks += len(decoded)
        identical += next((i for i, (a, b) in enumerate(zip(decoded, simulated)) if a != b),
                          min(len(decoded), len(simulated)))
        same_prompts += decoded == simulated
        accepted = [accepted[0] + sum(simulated), accepted[1] + sum(decoded)]
        num_blocks = [num_blocks[0] + len(simulated), num_blocks[1] + len(decoded)]
    return {"prompts": len(samples), "blocks": blocks, "identical_blocks": identical,
            "identical_prompts": same_prompts, "accepted_tokens": accepted, "num_blocks": num_blocks}


def teacher_forced_greedy(drafter, prompts: Prompts, answers: list[list[int]], vocab: int) -> list[TeacherForced]:
    predictions = drafter_predictions(drafter, [ids for _, _, ids in prompts], answers, vocab_size=vocab,
                                      progress=False)
    return [TeacherForced(pid, category, ids, answer, tokens, probs)
            for (pid, category, ids), answer, (tokens, probs) in zip(prompts, answers, predictions)]
