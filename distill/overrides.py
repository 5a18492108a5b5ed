"""The command line's ``key=value`` words, read before Hydra reads them.

Hydra's override grammar takes ``~`` and ``=`` as operators and reports a misspelt key, a scalar for a
list or a setting that a given run makes moot only once the stage has started, or not at all. These
functions take the words as the user typed them and return what Hydra can read, or refuse with one line
that names what to change (exit code 2), before any model loads.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from distill.config import CONF_DIR, to_config
from distill.errors import ConfigError, PromptError

# Hydra flags that take a value (the next word), e.g. `--cfg job`.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
_INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
_OPTIONAL_VALUE_FLAGS = {"--info": _INFO_CHOICES, "-i": _INFO_CHOICES}


def split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """Separate Hydra flags (with their values) from ``key=value`` overrides, keeping each in order."""
    flags, overrides = [], []
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not word.startswith("-"):
            overrides.append(word)
            continue
        flags.append(word)
        if word in _OPTIONAL_VALUE_FLAGS and "=" not in word:  # `--info` alone means `--info all`; without a
            # value here, the `stage=` override placed after the flags would be taken as its value
            value = args[i] if i < len(args) and args[i] in _OPTIONAL_VALUE_FLAGS[word] else None
            flags.append(value or "all")
            i += value is not None
        elif word in _VALUE_FLAGS and "=" not in word and i < len(args):
            flags.append(args[i])
            i += 1
    return flags, overrides




# keys whose values are folders or files: a leading ~/ there is the home folder
_PATH_KEYS = ("outputs", "inputs.", "data.path", "export.path", "evaluate.prompts", "target.name", "drafter.name",
              "distill.resume")


def _expand_home(item: str) -> str:
    """``~/x`` -> ``/home/me/x``, also inside the quotes or after the list bracket the item may carry."""
    lead = len(item) - len(item.lstrip("[ '\""))
    return item[:lead] + os.path.expanduser(item[lead:]) if item[lead:].startswith("~/") else item


def readable_overrides(stage: str, overrides: list[str], multirun: bool = False) -> list[str]:
    """Overrides as Hydra can read them. A folder such as ``inputs.distill=~/runs/x`` or a sweep job's
    ``.../3_distill.lr=1e-4`` trips Hydra's grammar (``~`` and ``=`` are operators there), so a value Hydra
    cannot parse is quoted (with ``-m``, each comma-separated item: a sweep over folders; in a list, each
    item), which cannot change the meaning of any override Hydra accepts. In a path setting (``_PATH_KEYS``)
    an item starting with ``~/`` is expanded to the home folder. Exit 2 with what to write when quoting does
    not help either."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()

    def parses(text: str) -> bool:
        try:
            parser.parse_overrides([text])
            return True
        except OverrideParseException:
            return False

    readable = []
    for typed in overrides:
        override = typed
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~").startswith(_PATH_KEYS):
            # the shell leaves `key=~/x` alone (key is no shell variable), and Hydra reads ~ as an operator
            value = ",".join(_expand_home(item) for item in value.split(","))
            override = f"{key}={value}"
        if (sep and not multirun and key.lstrip("+~").startswith(_PATH_KEYS) and "," in value and parses(override)
                and parser.parse_overrides([override])[0].is_sweep_override() and parses(f"{key}='{value}'")):
            override = f"{key}='{value}'"  # without -m a comma in a folder is part of its name, not a sweep
        elif sep and not parses(override):
            bare = not any(ch in value for ch in "'\"[]{}")
            listed = value.startswith("[") and value.endswith("]") and not any(ch in value for ch in "'\"{}")
            candidates = []
            if bare:
                whole, items = f"{key}='{value}'", f"{key}=" + ",".join(f"'{item}'" for item in value.split(","))
                candidates = [items, whole] if multirun else [whole, items]
            elif listed:  # a list of folders: quote each item
                candidates = [f"{key}=[" + ",".join(f"'{item.strip()}'" for item in value[1:-1].split(",")) + "]"]
            override = next((c for c in candidates if parses(c)), override)
        if not parses(override):
            try:
                parser.parse_overrides([override])
            except OverrideParseException as err:
                reason = str(err).splitlines()[0]
            print(f"draftsmith {stage}: config error: cannot read {typed!r} ({reason}); write key=value, and "
                  f"put a value with spaces, quotes or ',' in quotes: \"key='value'\", or each item of a list: "
                  f"\"key=['a','b']\" (https://hydra.cc/docs/advanced/override_grammar/basic/)", file=sys.stderr)
            sys.exit(2)
        readable.append(override)
    return readable


def refuse_unknown_keys(stage: str, overrides: list[str]) -> None:
    """Exit 2 naming the closest real key when an override's key is not in the config (``distill.lrr=1``,
    ``distill.draft_length=4``); Hydra's own message says only that the key is not in the struct."""
    import dataclasses
    import difflib

    from distill.config import Config

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    all_keys = []  # every dotted key, for a key written under the wrong section
    for name, cls in ((f.name, f.default_factory) for f in dataclasses.fields(Config)
                      if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)):
        all_keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    for override in overrides:
        key, sep, _ = override.partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith(("~", "hydra")) or "@" in key or key in groups:
            continue
        cls, parts = Config, key.split(".")
        for depth, part in enumerate(parts):
            if cls is None:
                break  # inside a free-form value (a list, a dict): no schema to check against
            known = {f.name: f for f in dataclasses.fields(cls)}
            if part not in known:
                prefix = ".".join(parts[:depth])
                near = [f"{prefix}.{m}" if prefix else m for m in difflib.get_close_matches(part, known, n=2, cutoff=0.6)]
                if depth:  # the same key under another section (distill.draft_length for decode.draft_length)
                    near += [k for k in all_keys if k.endswith(f".{part}") and k != key and k not in near]
                    near += [m for m in difflib.get_close_matches(key, all_keys, n=2, cutoff=0.8) if m not in near]
                hint = f"did you mean {' or '.join(near)}?" if near else "no such setting"
                print(f"draftsmith {stage}: config error: unknown key {key}: {hint} (`draftsmith {stage} --cfg job` "
                      f"lists every key)", file=sys.stderr)
                sys.exit(2)
            factory = known[part].default_factory
            cls = factory if dataclasses.is_dataclass(factory) else None


def _list_keys(cls=None, prefix: str = "") -> dict[str, bool]:
    """Dotted keys of the config whose values are lists (e.g. ``drafter.layers``), each with whether
    it may be null."""
    import dataclasses
    import typing

    from distill.config import Config

    keys: dict[str, bool] = {}
    for f in dataclasses.fields(cls or Config):
        kind = typing.get_type_hints(cls or Config)[f.name]
        optional = typing.get_origin(kind) is typing.Union
        if optional:  # Optional[X] -> X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is list:
            keys[prefix + f.name] = optional
        elif dataclasses.is_dataclass(kind):
            keys.update(_list_keys(kind, f"{prefix}{f.name}."))
    return keys


def refuse_scalars_for_lists(stage: str, overrides: list[str]) -> None:
    """``drafter.layers=0`` would get Hydra's "int is not a ListConfig": say how to write a list instead.

    Raises:
        SystemExit(2): an override gives a list key something other than ``[...]`` (or null where allowed).
    """
    keys = _list_keys()
    for word in overrides:
        key, _, value = word.lstrip("+").partition("=")
        if key not in keys or value.startswith("[") or (value == "null" and keys[key]):
            continue
        items = value.strip("'\"")
        empty = "null" if keys[key] else "[]"
        hint = f"write '{key}=[{items}]' (quoted for the shell), or {key}={empty} for none"
        if not items or value == "null":
            hint = f"write '{key}=[...]' (quoted for the shell), or {key}={empty} for none"
        elif "," in items:  # a Hydra sweep over scalars, or a list without its brackets
            hint = (f"write '{key}=[{items}]' (quoted for the shell) for one list; a sweep (-m) over lists is "
                    f"'{key}=[0,1],[0,2]'")
        print(f"draftsmith {stage}: config error: {key} takes a list: {hint}", file=sys.stderr)
        sys.exit(2)


def refuse_bad_sweep_values(stage: str, flags: list[str], overrides: list[str], limit: int = 256) -> None:
    """With ``-m``: compose every combination of the swept values and check it (values, input folders, prompt
    counts against the prompt set), so that a bad value stops the sweep before its first job runs (Hydra would
    find it only when that job starts, maybe hours in)."""
    if not {"-m", "--multirun"} & set(flags):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(
            [o for o in overrides if not o.lstrip("+~").startswith("hydra")]):
        if not override.is_sweep_override():
            choices.append([override.input_line])
        elif override.is_discrete_sweep():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:  # ranges, intervals: the sweeper's business
            return
    combinations = list(itertools.islice(itertools.product(*choices), limit))
    prompt_sets: dict[tuple, list] = {}  # each prompt source read once for all the jobs
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for combination in combinations:
            try:
                config = to_config(compose(config_name="config", overrides=[f"stage={stage}", *combination]))
                inputs = config.inputs
                for key, folder in [(k, getattr(inputs, k)) for k in ("generate", "distill", "evaluate", "sweep")] + [
                        ("extra_generate", f) for f in inputs.extra_generate]:
                    if folder and not Path(folder).expanduser().is_dir():
                        raise ConfigError(f"inputs.{key}={folder} does not exist: pass a finished run's folder")
                _check_prompt_counts(stage, config, prompt_sets)
            except (ConfigError, PromptError) as err:
                swept = " ".join(c for c, options in zip(combination, choices) if len(options) > 1)
                print(f"draftsmith {stage}: config error in the sweep's job {swept}: {err}; no job was started",
                      file=sys.stderr)
                sys.exit(2)
            except Exception:  # noqa: BLE001 (composition errors: Hydra reports them itself, with its own words)
                return


def _check_prompt_counts(stage: str, config, prompt_sets: dict[tuple, list]) -> None:
    """For a job that answers prompts (generate, or a pipeline not given a generate or distill run): the
    training and held-out counts fit the prompt set, as the job's own split would find (with
    ``data.train_sources``, without ``data.max_prompt_tokens`` and ``data.max_train_prompt_tokens``, which need
    the tokenizer; ``data=sharegpt``'s ~90,000 prompts are not read).

    Raises:
        ConfigError: more prompts asked for than the set holds (the split's own message).
        PromptError: the prompt file is missing or malformed.
    """
    from distill.data.prompts import load_prompts, split_prompts

    data = config.data
    if stage not in ("generate", "pipeline") or data.source == "sharegpt" or \
            (stage == "pipeline" and (config.inputs.generate or config.inputs.distill)):
        return
    key = (data.source, data.path, data.on_bad_line, data.mixed_sharegpt)
    if key not in prompt_sets:
        prompt_sets[key] = load_prompts(data.source, data.path, on_bad_line=data.on_bad_line, skipped=[],
                                        sharegpt_turns=data.mixed_sharegpt)
    sources = set(data.train_sources) if data.train_sources is not None else None
    split_prompts(prompt_sets[key], num_train=config.generate.num_prompts, num_eval=config.evaluate.num_prompts,
                  seed=data.seed, train_keep=(lambda p: p.source in sources) if sources is not None else None,
                  train_limits=f"data.train_sources={data.train_sources}")


# What a pipeline given a finished run (inputs.<stage>) no longer does: settings of these groups would not apply.
_SKIPPED_BY_GIVEN_RUN = {"generate": ("generate", "data"), "distill": ("generate", "data", "distill", "drafter")}


def refuse_settings_of_given_runs(stage: str, overrides: list[str]) -> None:
    """Exit 2 when a pipeline is given a finished run (``inputs.generate``/``inputs.distill``) and also settings of
    the stages it then skips (``distill.lr=...`` beside ``inputs.distill=...``): they would be recorded in the
    run's config but change nothing, and a sweep over them would show a difference that is only noise."""
    if stage != "pipeline":
        return
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    given = [name for name in _SKIPPED_BY_GIVEN_RUN if f"inputs.{name}" in keys]
    if not given:
        return
    skipped = set(_SKIPPED_BY_GIVEN_RUN[given[-1]])  # inputs.distill skips the most
    unused = [k for k in keys if k.split(".", 1)[0].split("@", 1)[0] in skipped]
    if unused:
        print(f"draftsmith pipeline: config error: inputs.{given[-1]}=<run> reuses that finished run, so "
              f"{', '.join(unused)} would change nothing: drop {'it' if len(unused) == 1 else 'them'}, or drop "
              f"inputs.{given[-1]} to run that stage with these settings", file=sys.stderr)
        sys.exit(2)


def refuse_unwritable_outputs(stage: str, overrides: list[str]) -> None:
    """Exit 2 with a message when ``outputs=`` is a file or lies where nothing can be written (Hydra would
    otherwise fail creating the run folder with a traceback)."""
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("outputs=")), "outputs")
    if "," in value:  # a swept value: each job checks its own
        return
    path = Path(value).expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if existing.exists() and not existing.is_dir():
        problem = "is a file" if existing == path else f"lies under {existing}, which is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"cannot be created: {existing} is not writable"
    else:
        return
    print(f"draftsmith {stage}: error: outputs={value} {problem}; pass outputs=<a folder you can write>",
          file=sys.stderr)
    sys.exit(2)
