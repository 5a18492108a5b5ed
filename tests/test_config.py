"""Hydra composition, the typed schema and its range checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
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


def test_cli_config_error_exits_2_and_leaves_no_run_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distill.cli", "generate", "decode.draft_length=0",
                           f"outputs={tmp_path}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "decode.draft_length" in proc.stderr
    assert not list((tmp_path / "generate").glob("*")) if (tmp_path / "generate").exists() else True


def test_cli_help_and_cfg(tmp_path):
    usage = subprocess.run([sys.executable, "-m", "distill.cli", "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "pipeline" in usage.stdout
    cfg = subprocess.run([sys.executable, "-m", "distill.cli", "pipeline", "experiment=tiny", "--cfg", "job"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert cfg.returncode == 0 and "tiny-target" in cfg.stdout
    bad = subprocess.run([sys.executable, "-m", "distill.cli", "train"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown stage" in bad.stderr
