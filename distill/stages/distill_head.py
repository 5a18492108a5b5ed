"""Stage 2 for an EAGLE-3 head (``drafter=eagle3``): the target loads (its states are the head's input), the
head is built from it and the training answers (``distill.drafters.eagle3``), trained online
(``distill.training.head_loop.train_head``) and written to ``<run>/drafter/`` with ``drafter_info.json``.
``distill.run_distill`` hands over here once the data are read and split; the run folder, locks, resume and
manifest are the sibling's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distill.config import Config
from distill.drafters.eagle3 import initial_head
from distill.drafters.setup import DRAFTER_DIR, DRAFTER_INFO
from distill.files import atomic_dir, write_json_atomic
from distill.models.loading import ResolvedModel, eos_token_ids, load_model
from distill.runs import StageRun
from distill.tracking import make_logger, run_name
from distill.training.head_loop import train_head
from distill.training.resume import hold_lock, prepare_resume


def head_info(cfg: Config, target_res: ResolvedModel, head) -> dict:
    """What the saved head carries so that evaluate and export check it belongs to the target."""
    c = head.config
    return {"kind": "eagle3", "init": "eagle3", "target_name": cfg.target.name,
            "target_fingerprint": target_res.fingerprint, "base_name": cfg.drafter.name,
            "aux_layers": c.aux_layers, "draft_vocab_size": c.draft_vocab_size, "head_init": cfg.drafter.head_init,
            "ttt_steps": cfg.distill.ttt_steps, "loss": cfg.distill.loss, "target_source": "online",
            "parameters": sum(p.numel() for p in head.parameters())}


def run_head_distill(cfg: Config, run: StageRun, target_res: ResolvedModel, train_examples: list,
                     val_examples: list, key: str, mixed_precision: str) -> Path:
    """Train and save the head into ``run``'s folder; returns the folder.

    Raises:
        ConfigError: a draft vocabulary or aux layer the target cannot have.
        DraftsmithError: the loss became NaN/inf, or a checkpoint from other data.
    """
    d, run_dir = cfg.distill, run.path
    if d.method != "full":
        print(f"distill: the whole EAGLE-3 head trains (distill.method={d.method} does not apply to it)")
    target, target_tok, target_res = load_model(target_res, dtype=cfg.target.dtype)
    eos = eos_token_ids(target, target_tok)
    head = initial_head(target, [ex["completion_ids"] for ex in train_examples],
                        draft_vocab_size=cfg.drafter.draft_vocab_size, aux_layers=cfg.drafter.aux_layers,
                        head_init=cfg.drafter.head_init, always=eos, seed=d.seed)
    lock = hold_lock(run_dir)
    resume_from, resumed = prepare_resume(cfg, run_dir, key)
    logger = make_logger(cfg.logger, run_name("distill", run_dir), run_dir, config=dataclasses.asdict(cfg))
    pad = target_tok.pad_token_id if target_tok.pad_token_id is not None else eos[0]
    try:
        metrics = train_head(head, target, train_examples, dataclasses.replace(d, mixed_precision=mixed_precision),
                             output_dir=run_dir / "checkpoints", pad_token_id=pad, resume_from=resume_from,
                             val_examples=val_examples or None, logger=logger,
                             validation_draft_length=cfg.decode.draft_length)
        metrics["mixed_precision"] = mixed_precision
        logger.summary({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    finally:
        logger.finish()
    info = head_info(cfg, target_res, head)
    info["training_data"] = {"train_examples": len(train_examples), "val_examples": len(val_examples)}
    with atomic_dir(run_dir / DRAFTER_DIR) as tmp:
        head.save(tmp)
        target_tok.save_pretrained(tmp)
        write_json_atomic(tmp / DRAFTER_INFO, info)
    lock.close()
    return run.complete(artifacts=(DRAFTER_DIR,), drafter=info, num_train_examples=len(train_examples),
                        num_val_examples=len(val_examples), train=metrics, **resumed)
