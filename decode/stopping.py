"""Stop strings: end generation at the token that completes a given piece of text.

Speculative decoding emits several tokens per block, so the check runs over
each new token of a block in order and reports the first one whose decoded
text completes a stop string; everything after it is dropped, exactly as if
the target had decoded token by token. Like transformers' ``stop_strings``,
the stopping token is kept (the stop string is part of the output).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Find the first token completing any of ``stop_strings``.

    Decodes only a window of recent tokens (the longest stop string in
    characters plus a margin, in tokens), so each check costs O(window) no
    matter how long the output is. A token decodes to at least one character
    for the byte-level BPE tokenizers draftsmith ships; a tokenizer with
    many empty-text tokens could need a wider ``margin``.

    Raises:
        ValueError: an empty stop string, or stop strings without a tokenizer.
    """

    def __init__(self, stop_strings: Sequence[str], tokenizer, margin: int = 8):
        self.stop_strings = tuple(stop_strings)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer to decode tokens into text: pass tokenizer=")
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.stop_strings), default=0) + margin

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def _text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def first_stop(self, new_tokens: Sequence[int], start: int) -> int | None:
        """Index in ``new_tokens`` of the first token at or after ``start`` that completes a stop string.

        Args:
            new_tokens: generated tokens so far (prompt excluded).
            start: first index not yet checked (tokens before it completed no stop string).

        Returns:
            the index, or None if no stop string is completed.
        """
        if not self.stop_strings:
            return None
        for i in range(start, len(new_tokens)):
            window = new_tokens[max(0, i + 1 - self.window): i + 1]
            # earlier tokens completed no stop string, so one found now ends at token i
            if any(s in self._text(window) for s in self.stop_strings):
                return i
        return None
