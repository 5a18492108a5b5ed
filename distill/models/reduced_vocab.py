"""A reduced-vocabulary LM head for the drafter, as in EAGLE-3 (Li et al. 2025, arXiv:2503.01840).

The drafter predicts only the N most frequent target tokens of its training data (EAGLE-3 keeps
32k of Llama-3's 128k): its LM head is a matmul over N rows instead of V, which is most of a
small drafter's cost at decode time (Qwen2.5-0.5B: the 151,936 x 896 head is 136M of 494M
parameters). Speculative decoding stays lossless: the drafter's forward still returns logits over
the full vocabulary ``(..., V)``, ``-inf`` at every id outside the draft vocabulary, so those
tokens have draft probability exactly 0; the target's residual ``max(0, p - q)`` then covers
them (Leviathan et al. 2023, Alg. 1).

Why ``-inf`` rather than the dtype's most negative finite value: it gives probability exactly 0
in every dtype, and ``decode.sampling`` handles it without NaN (temperature divides -inf into
-inf; top-k's threshold is at worst -inf and masks nothing; softmax has at least one finite
entry; top-p sorts zeros last; the residual subtracts 0). A finite value would overflow to
``-inf`` anyway once divided by a temperature below 1 in float32, and would leak a tiny mass in
bfloat16.

On disk the drafter folder stays a plain ``save_pretrained`` folder of the *full* model (the
kept rows of its LM head are the trained reduced rows), so ``transformers``, vLLM and GGUF
converters load it as a full-vocabulary drafter; ``draft_vocab.safetensors`` beside it holds
``draft_to_target`` and the reduced head weight, and :func:`apply_saved_draft_vocab` (called by
:func:`distill.models.loading.load_model` and :func:`load_drafter`) reduces the model again on load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
FORMAT = "draftsmith-draft-vocab/1"


def draft_vocabulary(token_lists: Iterable[Sequence[int]], vocab_size: int, size: int,
                     always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` token ids the drafter keeps: the most frequent in ``token_lists``, plus ``always``.

    EAGLE-3 (Li et al. 2025, arXiv:2503.01840) keeps the most frequent target tokens of the
    training data. Deterministic: the ids in ``always`` (EOS ids, pad) come first; the remaining
    ``size - len(always)`` slots go to the other ids by descending count, ties (zero counts
    included) broken by ascending id. So when the data has fewer distinct tokens than ``size``,
    the set is filled with the lowest unused ids.

    Args:
        token_lists: sequences of token ids (the training completions), each id in ``[0, vocab_size)``.
        vocab_size: V, the number of rows of the full LM head.
        size: N, ``len(always) <= N <= V`` (duplicates in ``always`` count once).
        always: ids kept whatever their count, each in ``[0, vocab_size)``.

    Returns:
        LongTensor ``(N,)``, ids sorted ascending (``draft_to_target``: draft index -> target id).

    Raises:
        ValueError: ``size`` or an id out of range.
    """
    always = sorted({int(i) for i in always})
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size} (the LM head's rows), got {size}")
    if always and not 0 <= always[0] <= always[-1] < vocab_size:
        raise ValueError(f"always-kept ids {always} must be in [0, {vocab_size})")
    if len(always) > size:
        raise ValueError(f"draft vocabulary size {size} cannot hold the {len(always)} always-kept ids {always}")
    counts = token_counts(token_lists, vocab_size)
    counts[always] = -1  # taken already; sorts after every real count below
    order = torch.argsort(-counts, stable=True)  # descending count, ascending id among ties
    chosen = torch.cat([torch.tensor(always, dtype=torch.long), order[: size - len(always)]])
    return torch.sort(chosen).values


def token_counts(token_lists: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs: LongTensor ``(vocab_size,)``.

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())} "
                             f"is outside the vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def coverage(token_lists: Iterable[Sequence[int]], draft_to_target: torch.Tensor, vocab_size: int) -> float:
    """Share of the tokens in ``token_lists`` whose id is in ``draft_to_target`` (1.0 if there are none)."""
    counts = token_counts(token_lists, vocab_size)
    total = int(counts.sum())
    return float(counts[draft_to_target.cpu()].sum()) / total if total else 1.0


class ReducedHead(nn.Module):
    """LM head over the N kept rows that returns full-vocabulary logits (EAGLE-3, arXiv:2503.01840).

    ``forward(hidden (..., H)) -> logits (..., V)``: ``proj`` (an ``nn.Linear(H, N)``, so
    ``torch.ao`` dynamic quantization and autocast see an ordinary linear layer) computes the N
    kept logits, which are scattered into a ``-inf``-filled ``(..., V)`` tensor at
    ``draft_to_target``. The matmul costs N/V of the full head's.

    Attributes:
        proj: ``nn.Linear(H, N)``; its weight is the trainable reduced head ``(N, H)``.
        draft_to_target: buffer LongTensor ``(N,)``, ascending target ids of the kept rows.
        out_features: V. in_features: H.
        was_tied: the full head was tied to the input embeddings before the reduction.
        full_weight: non-persistent buffer ``(V, H)``, the full head the reduction started
            from (rows outside the set, for saving a full-vocabulary model); absent when
            ``was_tied`` (the input embeddings serve instead).
    """

    def __init__(self, weight: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int,
                 bias: torch.Tensor | None = None, full_weight: torch.Tensor | None = None,
                 was_tied: bool = False) -> None:
        super().__init__()
        rows, hidden = weight.shape
        self.proj = nn.Linear(hidden, rows, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(weight)
            if bias is not None:
                self.proj.bias.copy_(bias)
        self.register_buffer("draft_to_target", draft_to_target.to(device=weight.device, dtype=torch.long))
        if full_weight is not None:
            self.register_buffer("full_weight", full_weight.detach(), persistent=False)
        else:
            self.full_weight = None
        self.out_features, self.in_features, self.was_tied = int(vocab_size), int(hidden), bool(was_tied)
        self.full_output = True  # False inside :func:`draft_vocabulary_logits`

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        reduced = self.proj(hidden_states)
        if not self.full_output:
            return reduced
        full = reduced.new_full((*reduced.shape[:-1], self.out_features), float("-inf"))
        return full.index_copy(-1, self.draft_to_target, reduced)

    def extra_repr(self) -> str:
        return f"draft_vocab={self.proj.out_features}, vocab={self.out_features}"


def _base_model(model: nn.Module) -> nn.Module:
    """The ``transformers`` model inside a peft wrapper (or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _refresh_tied_keys(model: nn.Module) -> None:
    if hasattr(model, "get_expanded_tied_weights_keys"):
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)


def _set_tied(model: nn.Module, tied: bool) -> None:
    model.config.tie_word_embeddings = tied
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if text_config is not model.config:
        text_config.tie_word_embeddings = tied
    _refresh_tied_keys(model)


def reduced_head(model: nn.Module) -> ReducedHead | None:
    """The model's :class:`ReducedHead`, or None for a full-vocabulary model (peft wrappers looked through)."""
    head = _base_model(model).get_output_embeddings()
    return head if isinstance(head, ReducedHead) else None


def draft_vocabulary_of(model: nn.Module) -> torch.Tensor | None:
    """``draft_to_target`` ``(N,)`` of a reduced drafter (plain, peft- or accelerate-wrapped), else None."""
    for module in model.modules():
        if isinstance(module, ReducedHead):
            return module.draft_to_target
    return None


@contextlib.contextmanager
def draft_vocabulary_logits(model: nn.Module) -> Iterator[torch.Tensor | None]:
    """Within the block a reduced drafter's forward returns its N kept logits ``(..., N)``, not
    ``(..., V)`` with ``-inf`` outside the set, so a loss over stored target ids (mapped by
    :func:`draft_indices`) skips the scatter and spends its softmax passes on N columns, not V.

    Yields ``draft_to_target`` ``(N,)``, or None for a full-vocabulary model (whose forward is
    unchanged). The heads return full logits again on leaving the block, also on an error.
    """
    heads = [module for module in model.modules() if isinstance(module, ReducedHead)]
    for head in heads:
        head.full_output = False
    try:
        yield heads[0].draft_to_target if heads else None
    finally:
        for head in heads:
            head.full_output = True


def draft_indices(target_ids: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """Target ids ``(...)`` -> their columns in the draft vocabulary ``(...)`` int64; ``N`` (one past
    the last column) for an id outside it, so a caller that appends one ``-inf`` column reads
    probability 0 there. ``draft_to_target`` ``(N,)`` must be ascending (it always is here)."""
    size = draft_to_target.numel()
    ids = target_ids.long()
    column = torch.searchsorted(draft_to_target, ids).clamp(max=size - 1)
    return torch.where(draft_to_target[column] == ids, column, torch.full_like(column, size))


def reduce_vocabulary(model: nn.Module, draft_to_target: torch.Tensor) -> nn.Module:
    """Replace the LM head of ``model`` by a :class:`ReducedHead` over the rows ``draft_to_target``.

    EAGLE-3 (Li et al. 2025, arXiv:2503.01840). In place; returns ``model``. The new head's
    weight ``(N, H)`` is a copy of the kept rows (a tied head is untied from the input
    embeddings first: ``config.tie_word_embeddings`` becomes False), and keeps the old head's
    ``requires_grad`` (trainable in full training, frozen under LoRA). The forward still returns
    ``(batch, seq, V)`` logits (``-inf`` outside the set), with ``logits_to_keep`` as an int or
    a boolean mask (transformers slices the hidden states before the head), with KV caches and
    ``generate``, inside a peft ``PeftModel`` and through ``merge_drafter``. A model that is
    reduced already is first restored to its full head (:func:`expand_vocabulary`).

    Args:
        model: a ``transformers`` causal LM (or a peft wrapper of one) whose LM head is
            ``get_output_embeddings()``, an ``nn.Linear(H, V)``.
        draft_to_target: LongTensor ``(N,)`` of distinct ids in ``[0, V)`` (see :func:`draft_vocabulary`).

    Raises:
        ValueError: ids out of range or repeated, or a head that is not an ``nn.Linear``.
    """
    base = _base_model(model)
    if reduced_head(base) is not None:
        expand_vocabulary(base)
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"cannot reduce the vocabulary of {type(base).__name__}: its LM head is a "
                         f"{type(head).__name__}, not an nn.Linear")
    vocab = head.out_features
    ids = torch.as_tensor(draft_to_target, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ValueError(f"draft_to_target must hold distinct ids in [0, {vocab}), got {ids.numel()} ids "
                         f"in [{int(ids.min()) if ids.numel() else '-'}, {int(ids.max()) if ids.numel() else '-'}]")
    ids = torch.sort(ids).values.to(head.weight.device)
    embeddings = base.get_input_embeddings()
    tied = embeddings is not None and head.weight is getattr(embeddings, "weight", None)
    with torch.no_grad():
        new = ReducedHead(head.weight[ids], ids, vocab, bias=None if head.bias is None else head.bias[ids],
                          full_weight=None if tied else head.weight, was_tied=tied)
    new.proj.weight.requires_grad_(head.weight.requires_grad)
    if new.proj.bias is not None:
        new.proj.bias.requires_grad_(head.bias.requires_grad)
    base.set_output_embeddings(new)
    if getattr(base.config, "tie_word_embeddings", False) or tied:
        _set_tied(base, False)
    return model


def expand_vocabulary(model: nn.Module) -> nn.Module:
    """Undo :func:`reduce_vocabulary`: a full ``nn.Linear(H, V)`` head again, in place; returns ``model``.

    Rows in the draft vocabulary are the (trained) reduced head's; the others are the head the
    reduction started from (for a head that was tied, the input embeddings as they are now).
    The head is tied to the input embeddings again if it was tied and every row still equals
    them (a frozen head), so the saved folder is as large as the original. No-op for a
    full-vocabulary model.
    """
    base = _base_model(model)
    head = reduced_head(base)
    if head is None:
        return model
    proj = head.proj
    embeddings = base.get_input_embeddings()
    if head.was_tied:
        source = embeddings.weight
    else:
        source = head.full_weight
    reduced_weight = proj.weight if isinstance(proj, nn.Linear) else None
    if reduced_weight is None:
        raise ValueError("cannot expand a quantized reduced head: expand the model before quantizing it")
    with torch.no_grad():
        reduced_weight = reduced_weight.detach().to(source.dtype)
        ids = head.draft_to_target.to(source.device)
        retie = head.was_tied and proj.bias is None and torch.equal(source[ids], reduced_weight.to(source.device))
        full = nn.Linear(head.in_features, head.out_features, bias=proj.bias is not None,
                         device=source.device, dtype=source.dtype)
        if retie:
            full.weight = embeddings.weight
        else:
            full.weight.copy_(source)
            full.weight[ids] = reduced_weight.to(source.device)
            if proj.bias is not None:
                full.bias.zero_()
                full.bias[ids] = proj.bias.detach().to(full.bias)
    full.weight.requires_grad_(proj.weight.requires_grad)
    base.set_output_embeddings(full)
    if retie:
        _set_tied(base, True)
    return model


@contextlib.contextmanager
def full_vocabulary(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block ``model`` has its full head (:func:`expand_vocabulary`); the reduced head
    comes back afterwards (same module, same parameters). For ``save_pretrained``."""
    base = _base_model(model)
    head = reduced_head(base)
    if head is None:
        yield model
        return
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    expand_vocabulary(base)
    try:
        yield model
    finally:
        base.set_output_embeddings(head)
        _set_tied(base, tied)


def restrict_logits(student_logits: torch.Tensor, target_logits: torch.Tensor, draft_to_target: torch.Tensor,
                    *, labels: torch.Tensor | None = None, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Both models' logits at the draft vocabulary only, for the distillation loss (EAGLE-3).

    EAGLE-3 (Li et al. 2025, arXiv:2503.01840) trains the reduced head against the target's
    distribution restricted to the draft vocabulary: the loss functions' ``log_softmax`` then
    renormalises the target over the N kept ids. Ids of ``draft_to_target`` beyond the target's
    vocabulary (embedding padding rows) are dropped.

    Args:
        student_logits: ``(..., V_s)`` drafter logits (``-inf`` outside the set for a reduced drafter).
        target_logits: ``(..., V_t)``, same leading shape.
        draft_to_target: LongTensor ``(N,)``, ascending target ids.
        labels: optional ``(...)`` int64 target ids (for ``kind="ce"``): mapped to draft indices;
            a label outside the set cannot be predicted, so its position is dropped from ``mask``
            (and its label set to 0).
        mask: optional ``(...)`` bool, True where the position counts; required with ``labels``.

    Returns:
        ``(student (..., N'), target (..., N'), labels or None, mask or None)`` with N' <= N columns.
    """
    ids = draft_to_target.to(student_logits.device)
    ids = ids[ids < min(student_logits.shape[-1], target_logits.shape[-1])]
    student = student_logits.index_select(-1, ids)
    target = target_logits.index_select(-1, ids.to(target_logits.device))
    if labels is not None:
        if mask is None:
            raise ValueError("restrict_logits: labels need a mask (positions with a label outside the set are dropped)")
        to_draft = torch.full((max(int(labels.max()) + 1 if labels.numel() else 0, student_logits.shape[-1]),), -1,
                              dtype=torch.long, device=labels.device)
        to_draft[ids.to(labels.device)] = torch.arange(ids.numel(), device=labels.device)
        mapped = to_draft[labels.long()]
        mask = mask & (mapped >= 0).to(mask.device)
        labels = mapped.clamp_min(0)
    return student, target, labels, mask


# ---------------------------------------------------------------------------------------------
# save / load


def save_reduced_vocab(model: nn.Module, folder: str | Path) -> Path | None:
    """Write ``folder/draft_vocab.safetensors`` for a reduced drafter; None (and nothing written) otherwise.

    The file holds ``draft_to_target`` ``(N,)`` int64 and ``lm_head.weight`` ``(N, H)`` (plus
    ``lm_head.bias`` if any) in the head's dtype, with metadata ``format`` and ``vocab_size``.
    """
    from safetensors.torch import save_file

    head = reduced_head(model)
    if head is None:
        return None
    if not isinstance(head.proj, nn.Linear):
        raise ValueError("cannot save a quantized reduced head: save the model before quantizing it")
    tensors = {"draft_to_target": head.draft_to_target.detach().cpu().contiguous(),
               "lm_head.weight": head.proj.weight.detach().cpu().contiguous()}
    if head.proj.bias is not None:
        tensors["lm_head.bias"] = head.proj.bias.detach().cpu().contiguous()
    path = Path(folder) / DRAFT_VOCAB_FILE
    save_file(tensors, str(path), metadata={"format": FORMAT, "vocab_size": str(head.out_features),
                                            "source": "EAGLE-3 reduced draft vocabulary (arXiv:2503.01840)"})
    return path


def save_drafter(model: nn.Module, folder: str | Path) -> None:
    """``save_pretrained`` of the full-vocabulary model (:func:`full_vocabulary`) plus, for a
    reduced drafter, ``draft_vocab.safetensors`` (:func:`save_reduced_vocab`)."""
    with full_vocabulary(model):
        model.save_pretrained(folder)
    save_reduced_vocab(model, folder)


def apply_saved_draft_vocab(model: nn.Module, folder: str | Path) -> nn.Module:
    """Reduce ``model`` (loaded from ``folder``) as ``folder/draft_vocab.safetensors`` says; no-op without it.

    In place; returns ``model``. The reduced head gets the stored weight (cast to the model's dtype).

    Raises:
        ValueError: the file does not fit the model (format, vocabulary size or shapes).
    """
    from safetensors import safe_open

    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return model
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    head = _base_model(model).get_output_embeddings()
    vocab = getattr(head, "out_features", None)
    if meta.get("format") != FORMAT or "draft_to_target" not in tensors or "lm_head.weight" not in tensors:
        raise ValueError(f"{path} is not a draftsmith draft vocabulary (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}): delete it to load the folder as a full-vocabulary model")
    if str(vocab) != meta.get("vocab_size"):
        raise ValueError(f"{path} was written for a vocabulary of {meta.get('vocab_size')} rows, but the model in "
                         f"{folder} has {vocab}: the file belongs to another model")
    ids, weight = tensors["draft_to_target"], tensors["lm_head.weight"]
    if weight.shape != (ids.numel(), head.in_features):
        raise ValueError(f"{path}: lm_head.weight {tuple(weight.shape)} does not fit {ids.numel()} ids x hidden "
                         f"{head.in_features}")
    reduce_vocabulary(model, ids)
    proj = reduced_head(model).proj
    with torch.no_grad():
        proj.weight.copy_(weight)
        if proj.bias is not None and "lm_head.bias" in tensors:
            proj.bias.copy_(tensors["lm_head.bias"])
    return model


def load_drafter(path: str | Path, dtype: str | torch.dtype = "float32") -> nn.Module:
    """A distilled drafter folder as the decoder runs it: ``from_pretrained`` + :func:`apply_saved_draft_vocab`.

    Returns the model in eval mode (reduced if the folder has ``draft_vocab.safetensors``).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return apply_saved_draft_vocab(model, path).eval()


def reduce_for_training(model: nn.Module, size: int, train_completions: Sequence[Sequence[int]],
                        val_completions: Sequence[Sequence[int]] = (), always: Iterable[int] = ()
                        ) -> tuple[torch.Tensor, dict]:
    """Pick the draft vocabulary from the training completions and reduce ``model`` to it (EAGLE-3).

    Args:
        model: the drafter (plain or peft-wrapped), full vocabulary V.
        size: N, see :func:`draft_vocabulary`.
        train_completions: the training examples' ``completion_ids`` (the target's answers).
        val_completions: held-out completions, for ``val_coverage`` only.
        always: ids always kept (the EOS ids; the model's ``config.pad_token_id`` is added); ids >= V are ignored.

    Returns:
        ``(draft_to_target (N,), record)``; ``record`` = ``{"size": N, "vocab_size": V, "coverage":
        share of training completion tokens in the set, "val_coverage": same on the held-out
        completions (None without them)}``, for the distill manifest.

    Raises:
        ValueError: ``size`` larger than V (or smaller than the always-kept ids).
    """
    base = _base_model(model)
    head = base.get_output_embeddings()
    vocab = head.out_features
    if reduced_head(base) is not None:
        expand_vocabulary(base)
    pad = getattr(base.config, "pad_token_id", None)
    always = [*always, *([int(pad)] if isinstance(pad, int) else [])]
    ids = draft_vocabulary(train_completions, vocab, size, always=[i for i in always if 0 <= int(i) < vocab])
    reduce_vocabulary(model, ids)
    record = {"size": int(size), "vocab_size": int(vocab),
              "coverage": round(coverage(train_completions, ids, vocab), 6),
              "val_coverage": round(coverage(val_completions, ids, vocab), 6) if len(val_completions) else None}
    return ids, record
