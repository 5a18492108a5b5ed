"""Each config field's help lives in its dataclass metadata, and ``draftsmith <stage> --help`` shows it."""

from __future__ import annotations

import dataclasses

import yaml

from distill.config import Config, annotated_yaml
from tests.distill.test_config import cli_in_process


def _fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every field of ``cls`` and of the sections below it."""
    found = []
    for f in dataclasses.fields(cls):
        found.append((prefix + f.name, f))
        if dataclasses.is_dataclass(f.default_factory):
            found += _fields(f.default_factory, f"{prefix}{f.name}.")
    return found


def test_every_config_field_has_its_help():
    fields = _fields(Config)
    sections = {key.split(".")[0] for key, _ in fields if "." in key}  # the walk reaches every section
    assert sections == {"target", "drafter", "data", "generate", "distill", "decode", "evaluate", "export", "check",
                        "logger", "inputs"}
    missing = [key for key, f in fields if not str(f.metadata.get("help", "")).strip()]
    assert missing == []


def _config_part(help_text: str) -> str:
    """The YAML between the ``== Config ==`` heading (and its line of explanation) and the footer."""
    after = help_text.split("== Config ==\n", 1)[1].split("\n", 2)[2]
    return after.split("\n\n\n", 1)[0] + "\n"


def test_stage_help_shows_each_key_with_its_help(tmp_path):
    proc = cli_in_process("generate", "--help", "generate.max_new_tokens=64", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    section = lines[lines.index("generate:         # stage 1: the target answers training prompts"):]
    section = section[:next(i for i, line in enumerate(section[1:], 1) if not line.startswith(" "))]
    assert "  max_new_tokens: 64  # answer tokens per prompt, at most" in section  # the override's value
    # a help too long to follow its key is wrapped onto comment lines above it
    store = section.index("  store_top_k: 20")
    assert section[store - 2:store] == [
        "  # keep the target's k most likely tokens + log-probs per answer token, so distill can run without",
        "  # the target (distill.target_source=stored); 0 = off. ~16 bytes x k per token on disk",
    ]
    assert proc.stdout.startswith("draftsmith generate: train and measure")  # Hydra's header and footer stay
    assert "data: file, humaneval, mixed, mtbench, sharegpt" in proc.stdout
    assert "Print the resolved config: draftsmith generate --cfg job" in proc.stdout


def test_help_config_is_the_composed_config_with_comments(tmp_path):
    shown = cli_in_process("distill", "--help", "experiment=tiny", cwd=tmp_path)
    plain = cli_in_process("distill", "--cfg", "job", "experiment=tiny", cwd=tmp_path)
    assert shown.returncode == 0 and plain.returncode == 0, shown.stderr + plain.stderr
    config = _config_part(shown.stdout)
    assert "  name: tiny-target  # shipped name, HF folder, .gguf file or hub id" in config
    assert yaml.safe_load(config) == yaml.safe_load(plain.stdout)
    assert "#" not in plain.stdout  # --cfg job stays plain YAML


def test_help_shows_a_value_with_a_dollar_sign(tmp_path):
    """Hydra's help template is a string.Template: a ``$`` of the config must reach the user as it is."""
    proc = cli_in_process("distill", "--help", "data.path=a$b", "outputs=${oc.env:HOME}/runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "  path: a$b" in proc.stdout.splitlines()
    assert "outputs: ${oc.env:HOME}/runs  # root of all run folders" in proc.stdout.splitlines()


def test_annotated_yaml_puts_a_block_value_below_its_help():
    text = annotated_yaml({"decode": {"stop_strings": ["```", "END"], "top_k": 5}, "extra": 1})
    assert text.splitlines() == [
        "decode:   # the speculative decoder evaluate runs",
        "  # stop after the token completing one of these",
        "  stop_strings:",
        "  - '```'",
        "  - END",
        "  top_k: 5  # sample from the k most likely tokens only; 0 = off",
        "extra: 1",  # not a Config key: no help
    ]
