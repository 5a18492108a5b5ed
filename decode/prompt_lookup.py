"""Prompt lookup (n-gram) drafting: the no-training baseline every serving stack offers.

The drafter is the context itself: find an earlier occurrence of the sequence's last n tokens
(n = ``max_ngram`` down to 1) and propose the K tokens that followed it. Same rule as transformers'
``PromptLookupCandidateGenerator`` (``generate(prompt_lookup_num_tokens=K)``, ``max_matching_ngram_size``
default 2): the earliest occurrence that has a continuation wins; vLLM's ``ngram`` speculator and
llama.cpp's lookup decoding are the same idea (Saxena 2023, "Prompt Lookup Decoding"). Its drafts depend
only on the context, so its acceptance is simulated without any model (``decode.acceptance``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_NGRAM = 2


def lookup_draft(context: Sequence[int], draft_length: int, max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Up to ``draft_length`` tokens proposed for what follows ``context`` (token ids); [] when no match.

    Raises:
        ValueError: max_ngram < 1.
    """
    if max_ngram < 1:
        raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
    context = list(context)
    length = len(context)
    if draft_length < 1:
        return []
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = context[length - n:]
        for start in range(0, length - n):  # occurrences before the tail itself, earliest first
            if context[start:start + n] == tail:
                follow = start + n
                return context[follow:min(follow + draft_length, length)]
    return []


@dataclass(frozen=True)
class PromptLookupDrafter:
    """A drafter for ``decode.speculative.speculative_generate`` that proposes by prompt lookup.

    Attributes:
        max_ngram: longest n-gram matched (transformers' ``max_matching_ngram_size``).
    """

    max_ngram: int = DEFAULT_MAX_NGRAM

    def __post_init__(self):
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram}")

    def propose(self, context: Sequence[int], draft_length: int) -> list[int]:
        """:func:`lookup_draft` with this drafter's ``max_ngram``."""
        return lookup_draft(context, draft_length, self.max_ngram)
