"""``draftsmith <stage> [hydra overrides]``: picks the stage, hands the rest to Hydra.

Everything after the stage name is a Hydra override (``distill.lr=3e-4``,
``experiment=quick``, ``-m`` for sweeps, ``--help``, ``--cfg job``).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from distill import parallel
from distill.config import STAGES, register_configs, to_config
from distill.errors import ConfigError, DraftsmithError
from distill.rundir import REUSED, write_json_atomic, write_text_atomic
from distill.tracking import check_logger

# conf/ sits at the project root (the user's layout), so draftsmith runs from a source checkout
# installed with `pip install -e .`; a non-editable wheel would need a copy in distill/conf.
_ROOT_CONF = Path(__file__).resolve().parent.parent / "conf"
CONF_DIR = _ROOT_CONF if _ROOT_CONF.is_dir() else Path(__file__).resolve().parent / "conf"

USAGE = """usage: draftsmith <stage> [key=value ...] [-m key=a,b ...] [--help] [--cfg job]   (draftsmith --version)

stages:
  generate   the target answers training prompts (a datasets dataset on disk)
  distill    the drafter learns the target's token distributions on that data
  evaluate   speculative decoding before/after distillation -> report.json, report.md
  export     the tuned drafter in Hugging Face format with a model card
  pipeline   all four in order in one run folder; prints the report path last
  check      pre-flight: tokenizers, drafter accuracy, acceptance, cost ratio c, recommended K (no training)
  gather     one table (Markdown, CSV) and plots for a -m sweep (inputs.sweep=<folder>, default the newest)

examples:
  draftsmith pipeline experiment=tiny
  draftsmith pipeline experiment=quick distill.lr=3e-4
  draftsmith distill inputs.generate=outputs/generate/<run> distill.loss=jsd
  draftsmith pipeline --cfg job
  draftsmith check drafter.init=layers drafter.num_layers=4
"""


def run_stage(cfg: DictConfig, run_dir: Path) -> float | None:
    """Run the stage named by ``cfg.stage`` in ``run_dir``; returns the metric a sweeper optimises (speedup)."""
    config = to_config(cfg)
    config_yaml = OmegaConf.to_yaml(cfg)
    check_logger(config.logger)  # wandb online without a key: refused now, not after the models load
    # Imported here so that `--help` and config errors stay fast.
    if config.stage == "generate":
        from distill.stages.generate import run_generate

        run_generate(config, run_dir, config_yaml)
        return None
    if config.stage == "distill":
        from distill.stages.distill import run_distill

        finished = run_distill(config, run_dir, config_yaml)
        if finished != run_dir:  # an earlier run already did it
            if _in_sweep():  # a sweep's job folder says where its result is
                write_json_atomic(run_dir / REUSED, {"distill_run": str(Path(finished).absolute())})
            else:  # no empty folder
                _remove_if_unused(run_dir, config.stage)
        return None
    if config.stage == "evaluate":
        from distill.stages.evaluate import run_evaluate

        report = run_evaluate(config, run_dir, config_yaml)
        print(report)
        return _speedup(report)
    if config.stage == "gather":
        from distill.stages.gather import run_gather

        print(run_gather(config, run_dir, config_yaml))
        return None
    if config.stage == "check":
        from distill.stages.check import run_check

        print(run_check(config, run_dir, config_yaml))
        return None
    if config.stage == "export":
        from distill.stages.export import run_export

        print(run_export(config, run_dir, config_yaml))
        return None
    from distill.stages.pipeline import run_pipeline

    report = run_pipeline(config, run_dir, config_yaml)
    print(report)
    return _speedup(report)


def _speedup(report_path: Path) -> float | None:
    import json

    try:
        return float(json.loads(Path(report_path).read_text())["speedup"])
    except (OSError, KeyError, ValueError):
        return None


def _in_sweep() -> bool:
    """Whether this Hydra job is one job of a ``-m`` sweep (its folder is kept and read by ``gather``)."""
    return HydraConfig.get().mode == RunMode.MULTIRUN


def _remove_if_unused(run_dir: Path, stage: str) -> None:
    """Delete ``run_dir`` if it holds only what Hydra put there (its config copy and the log), and its stage
    folder (``outputs/<stage>``) if that is then empty."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", f"{stage}.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            run_dir.parent.rmdir()  # only succeeds when empty: the first run of this stage was refused
        except OSError:
            pass


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if parallel.world_size() > 1:  # the main process of several (main() refused other stages)
            _distill_in_all_processes(lambda: (to_config(cfg), run_dir, OmegaConf.to_yaml(cfg)))
            return None
        return run_stage(cfg, run_dir)
    except DraftsmithError as err:
        kind = "config error" if isinstance(err, ConfigError) else "error"
        if _in_sweep():  # a sweep's job: `gather` shows why it failed
            from distill.stages.gather import ERROR_FILE

            write_text_atomic(run_dir / ERROR_FILE, f"{kind}: {err}\n")
        else:
            _remove_if_unused(run_dir, cfg.stage)  # a refused run wrote nothing of its own: leave no empty folder
        print(f"draftsmith {cfg.stage}: {kind}: {err}", file=sys.stderr)
        sys.exit(2)


def _distill_in_all_processes(share: Callable[[], tuple] | None) -> None:
    """The distill stage in every launched process: the main one shares its checked config, run folder
    and config text (``share``, run inside Hydra); the others (``share=None``) never run Hydra, so they
    make no run folder of their own, and train in the main process's."""
    config, run_dir, config_yaml = parallel.from_main(share)
    from distill.stages.distill import run_distill

    run_distill(config, run_dir, config_yaml)


def _follow_main() -> None:
    """A launched process other than the main one: train with it; errors the main process relays are
    reported there, so they end this process quietly (rc 2)."""
    try:
        _distill_in_all_processes(None)
    except DraftsmithError as err:
        if not getattr(err, "relayed", False):
            kind = "config error" if isinstance(err, ConfigError) else "error"
            print(f"draftsmith distill (process {parallel.launcher_rank()}): {kind}: {err}", file=sys.stderr)
        sys.exit(2)


# Hydra flags that do not run the stage (help, printing the config, completion) or run several jobs.
_NOT_IN_PARALLEL = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                    "--shell-completion", "-sc", "--multirun", "-m", "--experimental-rerun"}


def _refuse_in_parallel(stage: str, flags: list[str]) -> None:
    """Under a launcher's N processes (WORLD_SIZE > 1): only a plain ``distill`` run is data-parallel."""
    why = None
    if stage != "distill":
        why = (f"only the distill stage trains data-parallel; run `draftsmith {stage}` as one process "
               "(without torchrun / accelerate launch)")
    elif used := [f for f in flags if f.split("=", 1)[0] in _NOT_IN_PARALLEL]:
        why = f"{' '.join(used)} does not run one distill job: use it without torchrun / accelerate launch"
    if why:
        if parallel.launcher_rank() == 0:  # once, not N times
            print(f"draftsmith {stage}: error: WORLD_SIZE={parallel.world_size()}: {why}", file=sys.stderr)
        sys.exit(2)


# Hydra flags that take a value (the next word), e.g. `--cfg job`.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
_INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
_OPTIONAL_VALUE_FLAGS = {"--info": _INFO_CHOICES, "-i": _INFO_CHOICES}


def _split_flags(args: list[str]) -> tuple[list[str], list[str]]:
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


def _readable_overrides(stage: str, overrides: list[str], multirun: bool = False) -> list[str]:
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


def _refuse_unknown_keys(stage: str, overrides: list[str]) -> None:
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


def _refuse_scalars_for_lists(stage: str, overrides: list[str]) -> None:
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


def _refuse_bad_sweep_values(stage: str, flags: list[str], overrides: list[str], limit: int = 256) -> None:
    """With ``-m``: compose every combination of the swept values and check it, so that a bad value stops the
    sweep before its first job runs (Hydra would find it only when that job starts, maybe hours in)."""
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
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for combination in combinations:
            try:
                config = to_config(compose(config_name="config", overrides=[f"stage={stage}", *combination]))
                inputs = config.inputs
                for key, folder in [(k, getattr(inputs, k)) for k in ("generate", "distill", "evaluate", "sweep")] + [
                        ("extra_generate", f) for f in inputs.extra_generate]:
                    if folder and not Path(folder).expanduser().is_dir():
                        raise ConfigError(f"inputs.{key}={folder} does not exist: pass a finished run's folder")
            except ConfigError as err:
                swept = " ".join(c for c, options in zip(combination, choices) if len(options) > 1)
                print(f"draftsmith {stage}: config error in the sweep's job {swept}: {err}; no job was started",
                      file=sys.stderr)
                sys.exit(2)
            except Exception:  # noqa: BLE001 (composition errors: Hydra reports them itself, with its own words)
                return


# What a pipeline given a finished run (inputs.<stage>) no longer does: settings of these groups would not apply.
_SKIPPED_BY_GIVEN_RUN = {"generate": ("generate", "data"), "distill": ("generate", "data", "distill", "drafter")}


def _refuse_settings_of_given_runs(stage: str, overrides: list[str]) -> None:
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


def _refuse_unwritable_outputs(stage: str, overrides: list[str]) -> None:
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


_AFTER_STOP = {  # what a stopped stage kept, and what running it again does
    "generate": "its finished shards are kept: the same command again answers only the rest",
    "distill": "the same command again resumes from the run's last checkpoint (distill.checkpoint_every; the "
               "steps after it are trained again)",
    "pipeline": "the same command again reuses what finished (generate's shards, a finished distill run) and "
                "resumes distill from its last checkpoint",
}
_UNFINISHED = "its run folder stays without COMPLETE (later stages skip it; delete it at will): run it again"


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `timeout`'s stop), raised like Ctrl-C so that the same cleanup runs."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``draftsmith``."""
    args = sys.argv[1:] if argv is None else argv
    stage = args[0] if args else ""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        try:
            _main(argv)
        finally:
            sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not in the interpreter's exit
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: one line, not a traceback through torch
        how = "SIGTERM" if isinstance(stop, _Terminated) else "Ctrl-C"
        after = _AFTER_STOP.get(stage, _UNFINISHED)
        print(f"\ndraftsmith {stage}: stopped ({how}); {after}", file=sys.stderr)
        sys.exit(143 if isinstance(stop, _Terminated) else 130)
    except BrokenPipeError:  # `draftsmith pipeline --help | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's docs, "Note on SIGPIPE"
        sys.exit(1)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"draftsmith {version('draftsmith')}")
        return
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"draftsmith: unknown stage {stage!r}; choose one of {', '.join(STAGES)}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Library chatter (per-load progress bars, bitsandbytes kernel notices) drowns the stage's own bars.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    register_configs()
    flags, overrides = _split_flags(rest)
    overrides = _readable_overrides(stage, overrides, multirun=bool({"-m", "--multirun"} & set(flags)))
    _refuse_unknown_keys(stage, overrides)
    _refuse_scalars_for_lists(stage, overrides)
    _refuse_unwritable_outputs(stage, overrides)
    _refuse_settings_of_given_runs(stage, overrides)
    _refuse_bad_sweep_values(stage, flags, overrides)
    if parallel.world_size() > 1:  # torchrun / accelerate launch: N processes, one distill run
        _refuse_in_parallel(stage, flags)
        try:
            state = parallel.start()
        except DraftsmithError as err:
            if parallel.launcher_rank() == 0:
                print(f"draftsmith {stage}: error: {err}", file=sys.stderr)
            sys.exit(2)
    # Hydra's parser wants flags before the overrides; users put them anywhere.
    # (--hydra-help composes Hydra's own config, which has no `stage`)
    stage_override = [] if "--hydra-help" in flags else [f"stage={stage}"]
    sys.argv = [f"draftsmith {stage}", *flags, *stage_override, *overrides]
    run = _follow_main if parallel.world_size() > 1 and not state.is_main_process else _hydra_main
    try:
        run()
    except SystemExit as done:  # sys.exit(2) after a reported error: leave without waiting for the others
        parallel.finish(ok=done.code in (None, 0))
        raise
    except BaseException:
        parallel.finish(ok=False)
        raise
    parallel.finish()


if __name__ == "__main__":
    main()
