"""Hydra composition, the typed schema and its range checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from distill.cli import CONF_DIR
from distill.config import Config, register_configs, to_config
from distill.errors import ConfigError


def _compose(*overrides: str) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_default_is_the_shipped_qwen_pair():
    cfg = _compose()
    assert cfg.target.name == "qwen2.5-coder-1.5b-instruct"
    assert cfg.drafter.name == "qwen2.5-coder-0.5b-instruct"
    assert cfg.drafter.init == "sibling"
    assert cfg.distill.loss == "fkl"
    assert cfg.logger.kind == "wandb" and cfg.logger.mode == "offline"


def test_default_recipe_is_the_budget_curves_best_point():
    """RESULTS.md: full fine-tuning of the whole sibling at lr 2e-6, about 10k tokens (13 steps of 4 examples)."""
    cfg = _compose()
    assert (cfg.distill.method, cfg.distill.lr, cfg.distill.lr_schedule) == ("full", 2e-6, "constant")
    assert cfg.distill.max_steps * cfg.distill.batch_size * cfg.distill.grad_accum == 52
    assert cfg.drafter.draft_vocab_size is None and cfg.evaluate.compare_vocab_sizes == [64000]
    assert _compose("experiment=tiny").evaluate.compare_vocab_sizes == []


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    cfg = _compose(f"experiment={experiment}")
    assert cfg.experiment == experiment


def test_tiny_and_quick_pick_their_models():
    tiny = _compose("experiment=tiny")
    assert (tiny.target.name, tiny.drafter.init, tiny.drafter.num_layers) == ("tiny-target", "layers", 1)
    quick = _compose("experiment=quick")
    assert quick.target.name == "qwen2.5-coder-0.5b-instruct"
    assert quick.drafter.init == "layers" and quick.drafter.num_layers == 4


def test_user_keys_keep_their_names():
    cfg = _compose("generate.num_prompts=5", "generate.max_new_tokens=7", "generate.temperature=0.5",
                   "distill.loss=jsd", "distill.jsd_beta=0.25", "distill.lr=3e-4", "distill.max_steps=9",
                   "decode.draft_length=6", "decode.temperature=0.7", "decode.max_new_tokens=11",
                   "target.name=a", "drafter.name=b")
    assert (cfg.generate.num_prompts, cfg.generate.max_new_tokens, cfg.generate.temperature) == (5, 7, 0.5)
    assert (cfg.distill.loss, cfg.distill.jsd_beta, cfg.distill.lr, cfg.distill.max_steps) == ("jsd", 0.25, 3e-4, 9)
    assert (cfg.decode.draft_length, cfg.decode.temperature, cfg.decode.max_new_tokens) == (6, 0.7, 11)
    assert (cfg.target.name, cfg.drafter.name) == ("a", "b")


def test_misspelled_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        _compose("distill.lrr=3e-4")


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException, match="draft_length"):
        _compose("decode.draft_length=many")


@pytest.mark.parametrize("override, key", [
    ("decode.draft_length=0", "decode.draft_length"),
    ("decode.draft_length=100000", "decode.draft_length"),  # more than decode.max_new_tokens can use
    ("decode.temperature=-0.1", "decode.temperature"),
    ("decode.top_p=0", "decode.top_p"),
    ("decode.top_p=1.5", "decode.top_p"),
    ("distill.jsd_beta=1.5", "distill.jsd_beta"),
    ("distill.lora_r=0", "distill.lora_r"),
    ("distill.loss=kl", "distill.loss"),
    ("generate.temperature=-1", "generate.temperature"),
    ("generate.num_prompts=0", "generate.num_prompts"),
    ("drafter.init=layers", "drafter.num_layers"),
    ("data.source=file", "data.path"),
])
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _compose(override)


REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``draftsmith ARGS`` from this checkout (PYTHONPATH), whatever copy is pip-installed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "distill.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def cli_in_process(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``draftsmith ARGS`` through the CLI's entry point (``distill.cli.main``) in this process, answered like
    :func:`cli`: exit code, stdout, stderr.

    For commands that end before any model loads (a refused config or input, ``--cfg job``, ``--help``): a
    child process takes 3-5 s for them on 2 cores, most of it importing torch, transformers and Hydra, which
    this process has already done; here they take a fraction of a second.
    Exit codes are the interpreter's: a SystemExit's code (None -> 0, a message -> printed, 1), and 1 with
    the traceback on stderr for an exception that escapes. What the CLI changes in the process is put back:
    argv, the working folder, the SIGTERM handler, the logging Hydra configures (its file handler closed),
    the progress-bar switches, and Hydra's global state (else the next ``initialize_config_dir`` refuses).
    Tests about the process itself (signals, pipes, the real exit of ``python -m distill.cli``) use :func:`cli`.
    """
    import contextlib
    import io
    import logging
    import signal
    import traceback

    import datasets.utils
    from hydra.core.global_hydra import GlobalHydra
    from transformers.utils import logging as hf_logging

    from distill import cli as cli_module

    root = logging.getLogger()
    bnb = logging.getLogger("bitsandbytes")
    saved = dict(argv=list(sys.argv), cwd=os.getcwd(), sigterm=signal.getsignal(signal.SIGTERM),
                 handlers=root.handlers[:], level=root.level, bnb_level=bnb.level,
                 hf_bars=hf_logging.is_progress_bar_enabled(), ds_bars=not datasets.utils.are_progress_bars_disabled())
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    _wait_for_a_new_run_folder(args, cwd)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli_module.main(list(args))
            except SystemExit as done:
                code = done.code
                if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
                    print(code, file=sys.stderr)
                    code = 1
            except Exception:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved["argv"]
        os.chdir(saved["cwd"])
        signal.signal(signal.SIGTERM, saved["sigterm"])
        for handler in root.handlers:
            if handler not in saved["handlers"]:
                handler.close()
        root.handlers[:] = saved["handlers"]
        root.setLevel(saved["level"])
        bnb.setLevel(saved["bnb_level"])
        if saved["hf_bars"]:
            hf_logging.enable_progress_bar()
        if saved["ds_bars"]:
            datasets.utils.enable_progress_bars()
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(["draftsmith", *args], code or 0, out.getvalue(), err.getvalue())


def _wait_for_a_new_run_folder(args: tuple[str, ...], cwd: Path | None) -> None:
    """Hydra names a run's folder by the second it starts (conf/hydra/default.yaml: <outputs>/<stage>/<date>_<time>).
    A child process gets there 2-3 s after the command before it; this process at once. When the folder of this
    second exists already (a command that just ran), wait for the next second, as the child would have: a refused
    command must not write its .hydra/ into another run's folder."""
    import datetime
    import time

    if not args or args[0].startswith("-") or {"-m", "--multirun"} & set(args):
        return
    outputs = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("outputs=")), "outputs")
    folder = Path(cwd or ".") / Path(outputs).expanduser() / args[0]
    now = datetime.datetime.now()
    if (folder / now.strftime("%Y-%m-%d_%H-%M-%S")).exists():
        time.sleep(1.05 - now.microsecond / 1e6)


def test_cli_config_error_exits_2_and_leaves_no_run_folder(tmp_path):
    # the real command in a child process: its exit status (the refusals below run the entry point in-process)
    proc = cli("generate", "decode.draft_length=0", f"outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "decode.draft_length" in proc.stderr
    assert not list((tmp_path / "generate").glob("*"))


@pytest.mark.parametrize("override, hint", [
    ("drafter.layers=0", "'drafter.layers=[0]'"),
    ("evaluate.compare_drafters=qwen2.5-coder-0.5b-instruct", "'evaluate.compare_drafters=[qwen2.5-coder-0.5b-instruct]'"),
    ("inputs.extra_generate=outputs/generate/x", "'inputs.extra_generate=[outputs/generate/x]'"),
    ("evaluate.compare_drafters=null", "evaluate.compare_drafters=[] for none"),  # not Optional: [] is "none"
    ("drafter.layers=", "drafter.layers=null for none"),
    ("drafter.layers=0,1", "'drafter.layers=[0,1]' (quoted for the shell) for one list"),
])
def test_a_scalar_for_a_list_key_says_how_to_write_the_list(tmp_path, override, hint):
    proc = cli_in_process("distill", "experiment=tiny", override, f"outputs={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and hint in proc.stderr and "ListConfig" not in proc.stderr, proc.stderr
    ok = cli_in_process("distill", "experiment=tiny", "drafter.layers=[0]", "--cfg", "job", cwd=tmp_path)
    assert ok.returncode == 0 and "- 0" in ok.stdout, ok.stderr


def test_cli_help_and_cfg(tmp_path):
    usage = cli_in_process("--help")
    assert usage.returncode == 0 and "pipeline" in usage.stdout
    cfg = cli_in_process("pipeline", "experiment=tiny", "--cfg", "job", cwd=tmp_path)
    assert cfg.returncode == 0 and "tiny-target" in cfg.stdout
    bad = cli_in_process("train")
    assert bad.returncode == 2 and "unknown stage" in bad.stderr


def test_cli_flags_may_come_before_overrides(tmp_path):
    proc = cli_in_process("pipeline", "--cfg", "job", "experiment=tiny", "decode.draft_length=5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tiny-target" in proc.stdout and "draft_length: 5" in proc.stdout


def test_misspelled_experiment_is_refused(tmp_path):
    proc = cli_in_process("pipeline", "experiment=tinyy", cwd=tmp_path)
    assert proc.returncode != 0
    assert "experiment/tinyy" in proc.stderr + proc.stdout


def test_appended_unknown_key_is_refused():
    with pytest.raises(ConfigError, match=r"distill\.lrr"):
        _compose("+distill.lrr=1")


@pytest.mark.parametrize("override, key", [
    ("distill.lora_alpha=0", "distill.lora_alpha"),
    ("decode.schedule=adaptive", "decode.schedule"),
    ("decode.max_draft_length=2", "decode.max_draft_length"),
    ("decode.confidence_threshold=1.0", "decode.confidence_threshold"),
    ("decode.drafter_quantization=int4", "decode.drafter_quantization"),
    ("evaluate.target_engine=vllm", "evaluate.target_engine"),
    ("decode.stop_strings=['']", "decode.stop_strings"),
])
def test_more_ranges(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _compose(override)


def test_num_layers_without_layers_init_says_how_to_drop_it():
    with pytest.raises(ConfigError, match=r"drafter\.num_layers=null"):
        _compose("experiment=tiny", "drafter.init=sibling")


def test_explicit_layers_set_num_layers_and_are_checked():
    cfg = _compose("drafter=pruned", "drafter.layers=[0,1,2,22,23]")
    assert cfg.drafter.layers == [0, 1, 2, 22, 23] and cfg.drafter.kept_layers() == 5  # layers override num_layers
    with pytest.raises(ConfigError, match=r"drafter\.layers.*drafter\.init=layers"):
        _compose("drafter.layers=[0,1]")
    with pytest.raises(ConfigError, match=r"drafter\.layers.*ascending"):
        _compose("drafter=pruned", "drafter.layers=[3,1]")
    with pytest.raises(ConfigError, match=r"drafter\.layers"):
        _compose("drafter=pruned", "drafter.layers=[-1,2]")


def test_sweep_folder_names_are_single_folders():
    from distill.config import _slug

    assert _slug("data.path=/home/me/prompts.jsonl,decode.draft_length=2") == \
        "data.path=_home_me_prompts.jsonl,decode.draft_length=2"
    long = _slug("x=" + "a" * 500)
    assert len(long) <= 120 and "/" not in long and long != _slug("x=" + "a" * 499)
    assert _slug("") == "default"
    assert _slug("inputs.distill='/runs/0_loss=fkl,lr=2e-4'") == "inputs.distill=_runs_0_loss=fkl,lr=2e-4"


def test_slurm_launcher_config_composes():
    """conf/hydra/launcher/slurm.yaml on top of hydra-submitit-launcher (a test dependency, not a runtime one)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 1


def test_help_piped_into_a_reader_that_stops_early_prints_no_traceback(tmp_path):
    """`draftsmith pipeline --help | head -3`: the reader is gone before the help is written (`true` reads
    nothing and exits while Python is still importing)."""
    proc = subprocess.run(f"{sys.executable} -m distill.cli pipeline --help | true", shell=True, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("experiment, drafter, name, init", [
    ("tiny", "tiny", "tiny-drafter", "sibling"),
    ("quick", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", "sibling"),
])
def test_a_drafter_on_the_command_line_replaces_the_experiments_drafter(tmp_path, experiment, drafter, name, init):
    proc = cli_in_process("pipeline", f"experiment={experiment}", f"drafter={drafter}", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    drafter_cfg = proc.stdout.split("\ndrafter:\n", 1)[1].split("\ndata:", 1)[0]
    assert f"name: {name}" in drafter_cfg and f"init: {init}" in drafter_cfg and "num_layers: null" in drafter_cfg


@pytest.mark.parametrize("given, setting", [
    ("inputs.distill=x", "distill.lr=1e-3,2e-3"),
    ("inputs.distill=x", "drafter=pruned"),
    ("inputs.generate=x", "data=sharegpt"),
    ("inputs.generate=x", "generate.num_prompts=5"),
])
def test_a_pipeline_given_a_run_refuses_settings_of_the_stage_it_skips(tmp_path, given, setting):
    proc = cli_in_process("pipeline", "experiment=tiny", given, setting, f"outputs={tmp_path}", cwd=tmp_path)
    key = setting.split("=")[0]
    assert proc.returncode == 2 and f"{key} would change nothing" in proc.stderr, proc.stderr
    # settings of the stages that still run are fine (here the missing folder is what stops it)
    ok = cli_in_process("pipeline", "experiment=tiny", given, "decode.draft_length=2", "evaluate.num_prompts=1",
                        f"outputs={tmp_path}", cwd=tmp_path)
    assert "would change nothing" not in ok.stderr and "does not exist" in ok.stderr, ok.stderr


def test_dtype_auto_is_bfloat16_only_where_the_hardware_has_bf16_units(monkeypatch):
    import distill.hardware
    import distill.models.loading
    from distill.hardware import resolve_auto

    assert (_compose().target.dtype, _compose().drafter.dtype) == ("auto", "auto")  # the schema never probes
    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: False)
    cfg = resolve_auto(_compose())  # the shipped pair's default: dtype auto
    assert (cfg.target.dtype, cfg.drafter.dtype) == ("float32", "float32")
    monkeypatch.setattr(distill.hardware, "bf16_is_fast", lambda device=None: True)
    assert (resolve_auto(_compose()).target.dtype,
            resolve_auto(_compose("drafter=pruned")).drafter.dtype) == ("bfloat16", "bfloat16")
    assert resolve_auto(_compose("target.dtype=float32")).target.dtype == "float32"  # a named dtype is kept
    assert distill.models.loading._parse_dtype("auto") == torch.bfloat16
    with pytest.raises(ConfigError, match="target.dtype: must be one of"):
        _compose("target.dtype=fp8")
