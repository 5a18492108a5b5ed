"""``distill.*`` settings for tests that call the training loop directly.

The loop reads its settings from :class:`distill.config.DistillConfig`, whose defaults are the pipeline's
(checkpoint every 10 steps, keep 2, mixed precision auto). Loop tests start from a plainer baseline, so that
each test names only what it is about: a checkpoint at the end only, every checkpoint kept, float32
throughout (the same figures on every host kind).
"""

from __future__ import annotations

from distill.config import DistillConfig

LOOP_TEST_DEFAULTS = dict(max_steps=100, checkpoint_every=0, keep_checkpoints=0, mixed_precision="no",
                          target_source="online")


def loop_settings(**fields) -> DistillConfig:
    """A :class:`DistillConfig` of ``LOOP_TEST_DEFAULTS`` overridden by ``fields``."""
    return DistillConfig(**{**LOOP_TEST_DEFAULTS, **fields})
