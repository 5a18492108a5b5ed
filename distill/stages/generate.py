"""Stage 1: the target answers the training prompts (synthetic distillation data), or scores answers that exist.

``generate.answers=target`` has the target write every answer; ``generate.answers=dataset`` has it
score the answer each prompt comes with (:mod:`distill.data.scoring`): one teacher-forced forward per batch
instead of one forward per answer token, and the same rows; ``auto`` (the default) scores where every training
prompt comes with an answer.

Prompts are answered in batches and written in shards of ``generate.shard_size``
prompts, each shard atomically. Shards live in a cache folder keyed by the
target and the sampling settings, each named by its position and its prompts
(ids and texts), so running the same command again after a crash reuses every
finished shard and resumes at the first unfinished one, and a run with a larger
``generate.num_prompts`` only answers the new prompts.

Output (run folder): ``dataset/`` (a ``datasets`` dataset, one row per prompt; with
``generate.store_top_k=k`` each row also holds the target's top-k token ids and
log-probabilities at every completion position),
``eval_prompts.jsonl`` (the held-out evaluation prompts), ``manifest.json``, ``COMPLETE``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from datasets import Dataset, concatenate_datasets, load_from_disk
from tqdm.auto import tqdm

from decode.cpu_linear import use_onednn_linear
from decode.progress import heartbeat
from decode.teacher_forcing import batches_by_length
from distill import parallel
from distill.config import Config
from distill.data.generated import DATASET_DIR, EVAL_PROMPTS, select_prompts
from distill.data.prompts import Prompt, encode_prompt
from distill.data.scoring import encode_answer, require_answers, score_batch
from distill.data.vllm_answers import VllmAnswerer, require_vllm, vllm_installed
from distill.errors import ConfigError, OutOfMemoryError, PromptError, out_of_memory_bytes
from distill.files import atomic_dir, exclusive, write_json_atomic, write_text_atomic
from distill.hardware import process_device, release_memory
from distill.measure.simulation import answer_all, answers_file, answers_key, answers_target_key
from distill.models.loading import eos_token_ids, load_model
from distill.runs import StageRun
from distill.tracking import make_logger, run_name

log = logging.getLogger(__name__)


def _shard_key(fingerprint: str, cfg: Config, engine: str = "hf", scored: bool = False) -> str:
    """The settings every shard of a run shares: the target, the engine and the generation settings (not the
    prompts); ``scored``: the target scores existing answers (packed: :func:`distill.data.scoring.score_batch`)."""
    g = cfg.generate
    payload = json.dumps({**({"answers": g.answers} if g.answers != "target" else {}),
                          **({"scoring": "packed"} if scored else {}),  # other rounding than padded
                          **({"engine": engine} if engine != "hf" else {}),  # hf shards written before stay valid
                          "target": fingerprint, "dtype": cfg.target.dtype,
                          "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
                          "batch_size": g.batch_size, "batch_tokens": g.batch_tokens,
                          "shard_size": g.shard_size, "seed": cfg.data.seed,
                          # only when on, so shards written before the option existed stay valid
                          **({"store_top_k": g.store_top_k} if g.store_top_k else {})})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _shard_name(start: int, prompts: list[Prompt], with_answers: bool = False) -> str:
    """``shard-<start>-<hash>``: a shard is reused only for the same position *and* the same prompts (ids and
    texts), so raising ``generate.num_prompts`` keeps every full shard (the train prompts of a larger run
    begin with those of a smaller one: :func:`distill.data.prompts.split_prompts`) and an edited prompt file
    regenerates only the shards whose prompts changed (with ``with_answers``, whose answers changed too)."""
    texts = json.dumps([[p.id, p.messages, *([p.answer] if with_answers else [])] for p in prompts], sort_keys=True)
    return f"shard-{start:06d}-{hashlib.sha256(texts.encode()).hexdigest()[:12]}"


@torch.inference_mode()
def answer_batch(model, input_ids: list[list[int]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                 temperature: float, top_p: float, store_top_k: int = 0) -> list[dict]:
    """Answer a batch of tokenized prompts with ``model.generate`` (left-padded).

    Args:
        input_ids: ``batch`` prompts, each a list of token ids (ragged).
        store_top_k: if > 0, also keep the target's k most likely tokens and their
            log-probabilities (temperature 1, before any sampling warper) at every generated
            position, for distillation without the target (``distill.target_source=stored``).

    Returns:
        per prompt, a dict: ``completion_ids`` (the new tokens up to and including the first
        EOS), ``finish_reason`` (``"eos"`` or ``"length"``) and, with ``store_top_k``,
        ``top_k_ids`` (completion length x k ints) and ``top_k_logprobs`` (same shape, float32,
        nats, descending), row j being the distribution that token j was drawn from.
    """
    width = max(len(ids) for ids in input_ids)
    batch = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(input_ids):
        batch[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=batch.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id, return_dict_in_generate=True,
                         output_logits=store_top_k > 0, **sampling)
    top_ids = top_logprobs = None
    if store_top_k > 0:
        # out.logits: one (batch, vocab) tensor of raw logits per generated position
        steps = [torch.log_softmax(step.float(), dim=-1).topk(store_top_k, dim=-1) for step in out.logits]
        top_logprobs = torch.stack([s.values for s in steps], dim=1)  # (batch, new, k)
        top_ids = torch.stack([s.indices for s in steps], dim=1)
    results = []
    eos = set(eos_ids)
    for b, row in enumerate(out.sequences[:, width:].tolist()):
        end = next((i + 1 for i, tok in enumerate(row) if tok in eos), None)
        answer = {"completion_ids": row[:end] if end else row, "finish_reason": "eos" if end else "length"}
        if store_top_k > 0:
            n = len(answer["completion_ids"])
            answer["top_k_ids"] = top_ids[b, :n].tolist()
            answer["top_k_logprobs"] = top_logprobs[b, :n].tolist()
        results.append(answer)
    return results


def _answer_shards(engine, train: list[Prompt], encoded: list[list[int]], shard_root: Path, names: dict[int, str],
                   cfg: Config, *, pad_id: int, eos_ids: list[int], fingerprint: str,
                   given: list[tuple[list[int], str]] | None = None) -> tuple[int, int, float]:
    """Answer the training prompts shard by shard into ``shard_root`` (``names``: shard start -> folder name),
    skipping the shards already there; returns (answer tokens, prompt + answer tokens, seconds in the model) of
    the shards this process wrote now. ``engine``: the HF target, or a
    :class:`distill.data.vllm_answers.VllmAnswerer` that takes several shards in one continuously batched call.
    ``given``: the answers to score instead, per prompt (:func:`distill.data.scoring.encode_answer`). Of N
    launched processes, process r answers shards r, r + N, ...; all return once every shard is written.

    Raises:
        OutOfMemoryError: a batch did not fit, naming the settings to lower.
    """
    g = cfg.generate
    rank, processes = parallel.rank_and_size()
    starts = sorted(names)
    mine = starts[rank::processes]  # shard i to process i mod N: which shard is whose never changes a shard
    # two runs into one outputs= (a sweep, a retry) take turns here: the second reuses the first's shards; the
    # main process holds the lock for all processes of its own run
    lock = exclusive(shard_root, f"generate: another run is writing shards in {shard_root}; waiting for it "
                                 f"(the shards it finishes are reused, not written again)") \
        if parallel.is_main() else contextlib.nullcontext()
    with lock:
        parallel.barrier()  # the other processes start once the main one holds the lock
        done = [s for s in starts if (shard_root / names[s]).is_dir()]
        if done and parallel.is_main():
            print(f"generate: resuming, {len(done)}/{len(starts)} shards already finished in {shard_root}")

        size = {s: min(g.shard_size, len(train) - s) for s in starts}
        what = "score" if given else "generate"
        bar = tqdm(total=sum(size[s] for s in mine), initial=sum(size[s] for s in mine if s in done), unit="prompt",
                   desc=what if processes == 1 else f"{what} (process {rank + 1} of {processes})")
        counts = [0, 0, 0.0]  # answer tokens, prompt + answer tokens, seconds in the model
        todo = [s for s in mine if not (shard_root / names[s]).is_dir()]
        # vLLM batches continuously: a call gets enough shards to keep twice generate.batch_size prompts queued
        per_call = -(-2 * g.batch_size // g.shard_size) if isinstance(engine, VllmAnswerer) else 1
        for first in range(0, len(todo), per_call):
            group = todo[first:first + per_call]
            members = [i for start in group for i in range(start, start + size[start])]
            answered = _answer_members(engine, members, encoded, g, cfg.data.seed, shard_root, bar, counts,
                                       pad_id=pad_id, eos_ids=eos_ids, given=given)
            for start in group:
                rows = [{"prompt_id": train[i].id, "source": train[i].source, "category": train[i].category,
                         "prompt_ids": encoded[i], **answered[i], "temperature": g.temperature, "top_p": g.top_p,
                         "target_fingerprint": fingerprint}
                        for i in range(start, start + size[start])]  # in prompt order, whatever the batching
                with atomic_dir(shard_root / names[start]) as tmp:
                    Dataset.from_list(rows).save_to_disk(str(tmp))
        bar.close()
        parallel.barrier()  # every shard is on disk before the main process merges them (and lets the lock go)
    return counts[0], counts[1], counts[2]


def _answer_members(engine, members: list[int], encoded: list[list[int]], g, seed: int, shard_root: Path, bar,
                    counts: list, *, pad_id: int, eos_ids: list[int],
                    given: list[tuple[list[int], str]] | None) -> dict[int, dict]:
    """The answers to the training prompts ``members`` (positions in ``encoded``), by prompt position: the HF
    target in batches by length, reseeded at each shard's start (a resumed shard samples what it would have), or
    vLLM in one call seeded per prompt. Updates ``bar`` and ``counts`` (answer tokens, all tokens, seconds)."""
    answered: dict[int, dict] = {}

    def done(idx: list[int], seconds: float) -> None:
        counts[0] += sum(len(answered[i]["completion_ids"]) for i in idx)
        counts[1] += sum(len(encoded[i]) + len(answered[i]["completion_ids"]) for i in idx)
        counts[2] += seconds
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{counts[1] / max(counts[2], 1e-9):.1f}",
                        answer_tok_s=f"{counts[0] / max(counts[2], 1e-9):.1f}")

    if isinstance(engine, VllmAnswerer):
        t = time.perf_counter()
        answered.update(zip(members, engine.answer([encoded[i] for i in members],
                                                   [seed * 1_000_003 + i for i in members], eos_ids=eos_ids,
                                                   max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                                   top_p=g.top_p)))
        done(members, time.perf_counter() - t)
        return answered
    with heartbeat(bar, target=engine):
        for start in sorted({m - m % g.shard_size for m in members}):
            torch.manual_seed(seed * 1_000_003 + start)
            shard = [m for m in members if start <= m < start + g.shard_size]
            lengths = [len(encoded[i]) + (len(given[i][0]) if given else 0) for i in shard]
            for batch in batches_by_length(lengths, g.batch_tokens, g.batch_size):
                idx = [shard[k] for k in batch]
                t = time.perf_counter()
                answered.update(zip(idx, _answer_or_explain(engine, [encoded[i] for i in idx], idx, g, shard_root,
                                                            pad_id=pad_id, eos_ids=eos_ids,
                                                            given=[given[i] for i in idx] if given else None)))
                done(idx, time.perf_counter() - t)
    return answered


def _answer_or_explain(model, prompts: list[list[int]], idx: list[int], g, shard_root: Path, *, pad_id: int,
                       eos_ids: list[int], given: list[tuple[list[int], str]] | None = None) -> list[dict]:
    """:func:`answer_batch` on one batch (``idx``: the prompts' positions, for the message), or
    :func:`distill.data.scoring.score_batch` on the ``given`` answers.

    Raises:
        OutOfMemoryError: the batch did not fit, naming the settings to lower.
    """
    try:
        if given:
            return score_batch(model, prompts, given, store_top_k=g.store_top_k)
        return answer_batch(model, prompts, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=g.max_new_tokens,
                            temperature=g.temperature, top_p=g.top_p, store_top_k=g.store_top_k)
    except (MemoryError, RuntimeError) as err:
        if (asked := out_of_memory_bytes(err)) is None:
            raise
        size = f" (an allocation of {asked / 2**30:.2f} GiB failed)" if asked else ""
        raise OutOfMemoryError(
            f"out of memory answering prompts {sorted(idx)} in one batch{size}: lower "
            f"generate.batch_size (now {g.batch_size}), generate.batch_tokens (now {g.batch_tokens}) or "
            f"generate.max_new_tokens. Finished shards stay in {shard_root}; other batch settings write new shards "
            f"(batching changes the numerics)") from err


def _answer_held_out(model, tokenizer, held_out: list[Prompt], cfg: Config, run_dir: Path, *, pad_id: int,
                     eos_ids: list[int], fingerprint: str) -> tuple[float, str | None]:
    """The target's answers to the first ``evaluate.num_prompts`` held-out prompts, decoded as evaluate decodes
    (``decode.*``), into ``run_dir``: evaluate's exact acceptance reads them there, so every evaluate of a
    sweep on this data costs only its drafters' passes. Returns (seconds, the answers file's name or None
    when there is nothing to answer: no held-out prompts, or ``evaluate.prompts`` names other prompts)."""
    wanted = held_out[:cfg.evaluate.num_prompts]
    if not wanted or cfg.evaluate.prompts:
        return 0.0, None
    if parallel.is_main():
        print(f"generate: the target answers the {len(wanted)} held-out prompts too (decode.max_new_tokens="
              f"{cfg.decode.max_new_tokens}), for evaluate's exact acceptance")
    start = time.perf_counter()
    prompts = [(p.id, p.category, encode_prompt(tokenizer, p)) for p in wanted]
    common = dict(eos=eos_ids, batch_size=cfg.generate.batch_size, batch_tokens=cfg.generate.batch_tokens,
                  seed=cfg.evaluate.seed,
                  target_key=answers_target_key(fingerprint, cfg.target.dtype, model))
    # answered into outputs/.shards (as the training shards): a run again with other training prompts, or killed
    # after this point, reads them there; the run folder holds its own copy for evaluate
    answers = answer_all(model, prompts, cfg.decode, pad_id=pad_id, cache_dir=Path(cfg.outputs) / ".shards",
                         tokenizer=tokenizer, who="generate", **common)
    name = answers_file(answers_key(model, prompts, cfg.decode, **common))
    if parallel.is_main():
        write_json_atomic(run_dir / name, answers)
    return time.perf_counter() - start, name


#: training prompts from which ``generate.engine=auto`` starts vLLM on a CPU: its start (180-250 s on a 2-core
#: host) pays back once the HF path would generate for about 6 minutes, some 40 ShareGPT prompts (vLLM ran 1.9x
#: its rate there: docs/runs.md); twice that, for hosts where the two are closer
VLLM_CPU_MIN_PROMPTS = 128


def resolve_answers(cfg: Config, train: list[Prompt]) -> str:
    """``generate.answers`` as it will run: ``auto`` is ``dataset`` when every training prompt comes with an
    answer to score, else ``target``; said on the console when it was ``auto``.

    Raises:
        PromptError: ``dataset`` asked for prompts of which some carry no answer (before any model loads).
    """
    asked = cfg.generate.answers
    if asked == "dataset":
        require_answers(train)
    if asked != "auto":
        return asked
    with_answer = sum(bool(p.answer) for p in train)
    answers = "dataset" if train and with_answer == len(train) else "target"
    if parallel.is_main():
        print("generate: generate.answers=auto: " + (
            f"the target scores the answers the {len(train)} training prompts come with "
            f"(generate.answers=target has it write its own)" if answers == "dataset" else
            f"the target writes the training answers ({with_answer} of the {len(train)} training prompts come "
            f"with one; generate.answers=dataset scores only prompts that all do, e.g. data.train_sources=[sharegpt])"))
    return answers


def resolve_engine(cfg: Config, num_train: int) -> str:
    """``generate.engine`` as it will run: ``auto`` is vLLM where it is installed, the target writes the answers,
    one process runs, and a CUDA GPU is present or ``num_train`` reaches :data:`VLLM_CPU_MIN_PROMPTS`; otherwise
    transformers' ``generate``.

    Raises:
        ConfigError: ``vllm`` asked where it is not installed, with ``generate.answers=dataset``, or under a
            launcher of several processes.
    """
    g = cfg.generate
    processes = parallel.rank_and_size()[1]
    if g.engine == "auto":
        worth = torch.cuda.is_available() or num_train >= VLLM_CPU_MIN_PROMPTS
        return "vllm" if g.answers == "target" and processes == 1 and worth and vllm_installed() else "hf"
    if g.engine == "vllm":
        require_vllm()
        if g.answers == "dataset":
            raise ConfigError("generate.engine=vllm writes answers, and generate.answers=dataset scores the answers "
                              "that exist (one HF forward per batch): use generate.engine=hf or auto")
        if processes > 1:
            raise ConfigError(f"generate.engine=vllm runs its own workers: launch one process, not {processes} "
                              f"(torchrun / accelerate launch), or use generate.engine=hf")
    return g.engine


def _start_vllm(path: Path, dtype: str, encoded: list[list[int]], g, seed: int,
                shard_dirs: list[Path]) -> VllmAnswerer | None:
    """A vLLM engine sized to the prompts, or None when every shard is already written (a resumed run skips
    the engine's start, which takes minutes on a CPU)."""
    if all(d.is_dir() for d in shard_dirs):
        return None
    print(f"generate: starting vLLM on {path.name} ({dtype}; loading and compiling takes minutes on a CPU)")
    return VllmAnswerer(path, dtype=dtype, max_model_len=max(map(len, encoded)) + g.max_new_tokens,
                        max_num_seqs=g.batch_size, store_top_k=g.store_top_k, seed=seed)


def _check_context(model, tokenizer, train: list[Prompt], encoded: list[list[int]], held_out: list[Prompt],
                   cfg: Config) -> None:
    """Refuse prompts that do not fit the target's context with the tokens to generate (the held-out ones with
    ``decode.max_new_tokens``: evaluate decodes them later).

    Raises:
        PromptError: naming the first five and what to lower.
    """
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not context:
        return
    too_long = [(p.id, len(ids)) for p, ids in zip(train, encoded) if len(ids) + cfg.generate.max_new_tokens > context]
    too_long += [(p.id, n) for p in held_out
                 if (n := len(encode_prompt(tokenizer, p))) + cfg.decode.max_new_tokens > context]
    if too_long:
        shown = ", ".join(f"{i} ({n} tokens)" for i, n in too_long[:5])
        raise PromptError(f"{len(too_long)} prompt(s) do not fit the target's context of {context} tokens with "
                          f"the tokens to generate: {shown}; shorten or drop them, or lower "
                          f"generate.max_new_tokens / decode.max_new_tokens")


def _merge_shards(shards: list[Path], final: Path) -> Dataset:
    """The shards, in order, as one dataset written atomically to ``final`` (replacing one an earlier attempt in
    the same run folder left)."""
    dataset = concatenate_datasets([load_from_disk(str(shard)) for shard in shards])
    if final.exists():
        shutil.rmtree(final)
    with atomic_dir(final) as tmp:
        dataset.save_to_disk(str(tmp))
    return dataset


def _load_target(cfg: Config):
    """The target on this process's device, its float32 CPU layers through oneDNN (a batch's few rows per step,
    decode.cpu_linear): ``(model, tokenizer, ResolvedModel, seconds)``; says so first (it takes a while)."""
    t0 = time.perf_counter()
    print(f"generate: loading the target {cfg.target.name} ({cfg.target.dtype}) and preparing it to run", flush=True)
    model, tokenizer, resolved = load_model(cfg.target.name, dtype=cfg.target.dtype)
    model = model.to(process_device())
    use_onednn_linear(model)
    return model, tokenizer, resolved, time.perf_counter() - t0


def run_generate(cfg: Config, run_dir: Path, config_yaml: str = "") -> Path:
    """Run stage 1 into ``run_dir``; returns ``run_dir``.

    Raises:
        PromptError, ModelNotFoundError, ModelIntegrityError: bad prompts or model (before any generation).
    """
    skipped: list[str] = []
    too_long: list[str] = []
    train, held_out = select_prompts(cfg, skipped, too_long)  # prompt errors surface before the slow model load
    cfg = replace(cfg, generate=replace(cfg.generate, answers=resolve_answers(cfg, train)))
    scoring = cfg.generate.answers == "dataset"
    engine_name = resolve_engine(cfg, len(train))  # a missing vLLM is refused before the model loads
    if too_long:
        print(f"generate: passed over {len(too_long)} prompt(s) longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens} tokens (e.g. {', '.join(too_long[:3])})")
    main = parallel.is_main()  # of several launched processes, only the main one writes the run folder
    run = StageRun.start("generate", run_dir, config_yaml) if main else None
    model, tokenizer, resolved, load_s = _load_target(cfg)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    vocab = model.get_output_embeddings().out_features
    if cfg.generate.store_top_k > vocab:
        raise ConfigError(f"generate.store_top_k={cfg.generate.store_top_k} is more than the target's {vocab} "
                          f"tokens: use at most {vocab} (20 is plenty)")
    encoded = [encode_prompt(tokenizer, p) for p in train]
    _check_context(model, tokenizer, train, encoded, held_out, cfg)

    if main:
        # held-out prompts never need their answers (the target answers them for evaluate)
        write_text_atomic(run_dir / EVAL_PROMPTS, "".join(json.dumps({k: v for k, v in asdict(p).items() if k != "answer"})
                                                          + "\n" for p in held_out))

    g = cfg.generate
    key = _shard_key(resolved.fingerprint, cfg, engine_name, scored=scoring)
    shard_root = Path(cfg.outputs) / ".shards" / f"generate-{key}"
    starts = list(range(0, len(train), g.shard_size))
    names = {s: _shard_name(s, train[s:s + g.shard_size], scoring) for s in starts}
    given = [encode_answer(tokenizer, p, eos_ids, g.max_new_tokens) for p in train] if scoring else None
    answers_s = answers = None
    if engine_name == "vllm":
        # the HF target answers the held-out prompts first (evaluate decodes them with draftsmith's decoder) and
        # then makes room: vLLM takes most of a GPU's memory for its KV cache
        answers_s, answers = _answer_held_out(model, tokenizer, held_out, cfg, run_dir, pad_id=pad_id,
                                              eos_ids=eos_ids, fingerprint=resolved.fingerprint)
        dtype = str(model.dtype).removeprefix("torch.")
        model = None
        release_memory()
        engine = _start_vllm(resolved.path, dtype, encoded, g, cfg.data.seed, [shard_root / n for n in names.values()])
    else:
        engine = model
    try:
        new_tokens, all_tokens, gen_s = _answer_shards(engine, train, encoded, shard_root, names, cfg, pad_id=pad_id,
                                                       eos_ids=eos_ids, fingerprint=resolved.fingerprint, given=given)
    finally:
        if isinstance(engine, VllmAnswerer):
            engine.close()
    if main:
        dataset = _merge_shards([shard_root / names[s] for s in starts], run_dir / DATASET_DIR)
    if model is not None:
        answers_s, answers = _answer_held_out(model, tokenizer, held_out, cfg, run_dir, pad_id=pad_id,
                                              eos_ids=eos_ids, fingerprint=resolved.fingerprint)
    if not main:
        return run_dir
    lengths = dataset["completion_ids"]
    facts = {"num_train_prompts": len(train), "num_eval_prompts": len(held_out),
             "completion_tokens": sum(len(x) for x in lengths),
             "finished_with_eos": sum(r == "eos" for r in dataset["finish_reason"]),
             "generation_tokens_per_s": round(new_tokens / gen_s, 2) if gen_s else None,
             "processed_tokens_per_s": round(all_tokens / gen_s, 2) if gen_s else None,
             "skipped_prompt_lines": len(skipped)}
    logger = make_logger(cfg.logger, run_name("generate", run_dir), run_dir, config=asdict(cfg))
    try:
        logger.summary({k: v for k, v in facts.items() if v is not None})
    finally:
        logger.finish()
    return run.complete(
        artifacts=(DATASET_DIR, EVAL_PROMPTS, *([answers] if answers else [])),
        held_out_answers={"file": answers, "seconds": round(answers_s or 0.0, 2)} if answers else None,
        target={"name": cfg.target.name, "fingerprint": resolved.fingerprint, "source": resolved.source,
                "dtype": cfg.target.dtype},
        num_train_prompts=len(train), num_eval_prompts=len(held_out), shard_cache=str(shard_root),
        # what distill's resume key takes as the data's identity (the shared shard folder is not enough)
        data_identity=hashlib.sha256(json.dumps([str(shard_root), *names.values()]).encode()).hexdigest()[:24],
        store_top_k=g.store_top_k,
        answers=g.answers,  # who wrote the training answers: "target" (generated) or "dataset" (scored)
        completion_tokens=sum(len(x) for x in lengths),
        finished_with_eos=sum(r == "eos" for r in dataset["finish_reason"]),
        skipped_prompt_lines=skipped,
        prompts_over_max_tokens=len(too_long),
        model_load_s=round(load_s, 2),
        processes=parallel.rank_and_size()[1],
        engine=engine_name,  # what wrote the training answers: hf (transformers' generate) or vllm
        generation_tokens_per_s=round(new_tokens / gen_s, 2) if gen_s else None,  # the main process's shards
        processed_tokens_per_s=round(all_tokens / gen_s, 2) if gen_s else None,  # prompt + answer tokens
    )


