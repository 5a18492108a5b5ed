"""A generate run's contents as the later stages read them: the prompt split and the dataset on disk.

Generate writes them, distill trains on the dataset, evaluate and check take the held-out prompts; the
split is a pure function of ``data.*`` and the counts, so every stage agrees on which prompts are held out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from datasets import Dataset, load_from_disk

from distill.config import Config
from distill.data.prompts import Prompt, encode_prompt, load_prompts, split_prompts
from distill.models.loading import resolve_model

log = logging.getLogger(__name__)


DATASET_DIR = "dataset"


EVAL_PROMPTS = "eval_prompts.jsonl"


def select_prompts(cfg: Config, skipped: list[str] | None = None,
                   too_long: list[str] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """The training and held-out evaluation prompts for ``cfg`` (disjoint, deterministic in ``data.seed``).

    Malformed lines skipped under ``data.on_bad_line=skip`` are appended to ``skipped``, the ids of
    prompts passed over for ``data.max_prompt_tokens`` to ``too_long``.

    Raises:
        PromptError: the source is missing, empty or malformed.
        ConfigError: fewer prompts than asked for (within the length limit).
    """
    prompts = load_prompts(cfg.data.source, cfg.data.path, on_bad_line=cfg.data.on_bad_line, skipped=skipped,
                           sharegpt_turns=cfg.data.mixed_sharegpt)
    limit = prompt_length_limit(cfg)

    def keep(prompt: Prompt) -> bool:
        if limit(prompt):
            return True
        if too_long is not None:
            too_long.append(prompt.id)
        return False

    train_keep, train_limits = training_filter(cfg)
    return split_prompts(prompts, num_train=cfg.generate.num_prompts, num_eval=cfg.evaluate.num_prompts,
                         seed=cfg.data.seed, keep=keep if limit else None, train_keep=train_keep,
                         train_limits=train_limits)


def training_filter(cfg: Config) -> tuple[Callable[[Prompt], bool] | None, str]:
    """``data.train_sources`` and ``data.max_train_prompt_tokens`` as one test on a training prompt, with the
    settings it stands for (for messages); ``(None, "")`` when neither is set. Loads the target's tokenizer
    only for the length limit."""
    sources, limit = cfg.data.train_sources, cfg.data.max_train_prompt_tokens
    tests: list[Callable[[Prompt], bool]] = []
    named = []
    if sources is not None:
        allowed = set(sources)
        tests.append(lambda prompt: prompt.source in allowed)
        named.append(f"data.train_sources={list(sources)}")
    if limit is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.target.name).path)
        tests.append(lambda prompt: len(encode_prompt(tokenizer, prompt)) <= limit)
        named.append(f"data.max_train_prompt_tokens={limit}")
    if not tests:
        return None, ""
    return (lambda prompt: all(test(prompt) for test in tests)), " and ".join(named)


def prompt_length_limit(cfg: Config) -> Callable[[Prompt], bool] | None:
    """``data.max_prompt_tokens`` as a test on one prompt (its token count with the target's chat template),
    or None without a limit. Loads the target's tokenizer only."""
    limit = cfg.data.max_prompt_tokens
    if limit is None:
        if cfg.data.source == "sharegpt":  # data=sharegpt sets 512; data.source=sharegpt on another group does not
            log.warning("data.source=sharegpt without data.max_prompt_tokens: ShareGPT prompts of thousands of "
                        "tokens pad their whole generate batch to their length; data=sharegpt (or "
                        "data.max_prompt_tokens=512) passes them over")
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.target.name).path)
    return lambda prompt: len(encode_prompt(tokenizer, prompt)) <= limit


def load_generated(run_dir: Path) -> tuple[Dataset, list[Prompt], dict]:
    """The dataset, held-out prompts and manifest of a finished generate run."""
    from distill.runs import read_manifest, require_complete

    run_dir = require_complete(run_dir, "generate")
    dataset = load_from_disk(str(run_dir / DATASET_DIR))
    held_out = [Prompt(**json.loads(line)) for line in (run_dir / EVAL_PROMPTS).read_text().splitlines() if line]
    return dataset, held_out, read_manifest(run_dir)
