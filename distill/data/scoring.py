"""Answers that already exist, scored by the target: distillation data without generation.

``generate.answers=dataset`` reads each training prompt's ``answer`` (ShareGPT's reply, a user's logged
reply), tokenizes it as the assistant turn the chat template would render, and has the target score it in one
teacher-forced forward per batch (:func:`decode.teacher_forcing.answer_top_k`). The rows have generate's
format (``completion_ids``, ``finish_reason`` and, with ``generate.store_top_k``, the target's top-k ids and
log-probabilities per answer token), so distill reads them as it reads the target's own answers. This is
word-level knowledge distillation on a fixed corpus, the baseline DistillSpec (Zhou et al. 2024, Sec. 3)
sets against on-policy data.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode.packing import pack_rows
from decode.teacher_forcing import answer_top_k
from distill.data.prompts import Prompt
from distill.errors import DraftsmithError, PromptError
from distill.training.packing import check_packing


def require_answers(prompts: Sequence[Prompt], key: str = "generate.answers=dataset") -> None:
    """Refuse, before any model loads, training prompts that carry no answer to score.

    Raises:
        PromptError: naming how many lack one, their sources, and what gives answers.
    """
    missing = [p for p in prompts if not p.answer]
    if missing:
        sources = sorted({p.source for p in missing})
        raise PromptError(
            f"{key}: {len(missing)} of {len(prompts)} training prompts carry no answer to score (sources: "
            f"{', '.join(sources)}; e.g. {missing[0].id}). Answers come with data=sharegpt (the reply that "
            f"follows each opening turn) and with data=file (\"answer\" per line, or \"messages\" closing with an "
            f"assistant turn); or let the target write them: generate.answers=target")


def encode_answer(tokenizer, prompt: Prompt, eos_ids: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
    """``prompt.answer`` as the token ids the target would have emitted after ``encode_prompt(prompt)``:
    ``(completion_ids (n,), finish_reason)``, up to and including the end-of-turn token, at most
    ``max_tokens`` tokens (``"length"`` when cut there, else ``"eos"``).

    With a chat template the assistant turn is rendered by the template (so its end-of-turn token is the
    template's) and the part after the generation prompt is tokenized on its own, as generation starts a new
    token there; without one, the answer's tokens and the first EOS id.

    Raises:
        PromptError: the prompt has no answer, or the answer tokenizes to nothing.
    """
    if not prompt.answer:
        raise PromptError(f"prompt {prompt.id} has no answer to score (generate.answers=dataset)")
    ids = _answer_ids(tokenizer, prompt, eos_ids)
    eos = set(eos_ids)
    end = next((i + 1 for i, token in enumerate(ids) if token in eos), len(ids))
    ids = ids[:end]
    if len(ids) <= 1 and (not ids or ids[0] in eos):
        raise PromptError(f"prompt {prompt.id}: its answer tokenizes to no tokens; drop it from the data")
    if len(ids) > max_tokens:
        return ids[:max_tokens], "length"
    return ids, "eos" if ids[-1] in eos else "length"


def _answer_ids(tokenizer, prompt: Prompt, eos_ids: Sequence[int]) -> list[int]:
    reply = {"role": "assistant", "content": prompt.answer}
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*prompt.messages, reply], tokenize=False)
        if whole.startswith(head):
            return list(tokenizer(whole[len(head):], add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.answer, add_special_tokens=False)["input_ids"]) + list(eos_ids[:1])


def score_batch(model, prompt_ids: Sequence[Sequence[int]], answers: Sequence[tuple[list[int], str]], *,
                store_top_k: int) -> list[dict]:
    """Generate's rows for answers that exist: per prompt ``completion_ids``, ``finish_reason`` and, with
    ``store_top_k`` > 0, ``top_k_ids`` and ``top_k_logprobs`` (``len(completion) x k``, float32 nats) from one
    teacher-forced forward of the target over the batch; without it no forward runs (distill then scores
    online). ``answers``: :func:`encode_answer`'s output per prompt.

    The batch's prompt + answer sequences are packed end to end (:func:`decode.packing.pack_rows`, rows
    no longer than the longest sequence, so never more cells than padding) where the model keeps packed
    sequences apart (checked once per model, :func:`distill.training.packing.check_packing`), else padded."""
    rows = [{"completion_ids": ids, "finish_reason": reason} for ids, reason in answers]
    if store_top_k > 0:
        lengths = [len(p) + len(ids) for p, (ids, _) in zip(prompt_ids, answers)]
        layout = pack_rows(lengths, max(lengths)) if packs_apart(model) else None
        scored = answer_top_k(model, prompt_ids, [ids for ids, _ in answers], store_top_k, packed_rows=layout)
        for row, (top_ids, top_logprobs) in zip(rows, scored):
            row["top_k_ids"] = top_ids.tolist()
            row["top_k_logprobs"] = top_logprobs.tolist()
    return rows


def packs_apart(model) -> bool:
    """Whether ``model``'s attention keeps packed sequences apart (:func:`check_packing`), checked on the first
    call and remembered on the model; said once on the console when it does not (scoring then pads)."""
    known = getattr(model, "_draftsmith_packs_apart", None)
    if known is None:
        try:
            check_packing(model, "the target")
            known = True
        except DraftsmithError as refused:
            print(f"generate: scoring pads its batches instead of packing them: {refused}")
            known = False
        model._draftsmith_packs_apart = known
    return known
