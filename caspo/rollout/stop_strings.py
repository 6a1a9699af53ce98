"""Stop strings, checked as each token arrives: does the text the last token added complete one?

A stop string may end inside the last token's text: byte-level BPE merges punctuation with what follows
(`':\n'`, `'>\n'`, `'}\n\n'`), so "Problem:" can arrive in a token that also carries the newline after it.
As vLLM does, the sequence stops as soon as its text contains a stop string; the token that completed it is
kept whole. Only an occurrence that reaches into the last token's text can be new (an earlier one would have
stopped the sequence then), so the check looks there alone.

The check decodes the last tokens of the sequence (WINDOW, or four per character of the longest stop string,
so that one spelt in single bytes still fits), twice: with and without the last token, to know where its text
begins. That is a tokenizer call per running sequence per step (about 8 µs for Qwen's tokenizer: 8 ms a step
at 1,000 sequences, as long as the device's step). Most steps cannot complete a stop string, and this is
cheap to tell for a stop string whose last character c is ASCII and not whitespace:

    the last token completes the stop string only if the token's own text contains c.

A byte-level BPE text ends each token with that token's bytes, and an ASCII byte decodes to its own
character in any context; SentencePiece pieces and byte fallbacks keep their non-space characters too. A
token that adds no text completes nothing. So a step whose token's text lacks every such c is skipped; the
token's text is decoded once per token id. A stop string ending in whitespace or in a non-ASCII character
is checked every step.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

WINDOW = 32  # tokens decoded at least to look for a stop string


class StopStrings:
    def __init__(self, strings: Sequence[str], decode: Callable[[list[int]], str]):
        if any(not s for s in strings):
            raise ValueError(f"stop strings must be non-empty, got {list(strings)!r}")
        self.strings = list(strings)
        self.decode = decode
        # a UTF-8 character is at most 4 bytes, so at most 4 byte tokens; one more for a token cut at the start
        self.window = max(WINDOW, 4 * max(len(s) for s in self.strings) + 1)
        lasts = {s[-1] for s in self.strings}
        # The last characters the token filter can vouch for; with any other, every step is checked.
        self.every_step = any(not c.isascii() or c.isspace() for c in lasts)
        self.lasts = lasts
        self._may_end: dict[int, bool] = {}  # token id -> its text contains a stop string's last character

    def ended(self, tokens: list[int], context: Sequence[int] = ()) -> bool:
        """Whether the text of `context` + `tokens` holds a stop string that reaches into the last token's
        text (`context`: tokens before the generated ones that the text continues, Request.stop_context)."""
        if not self.every_step:
            token = tokens[-1]
            may_end = self._may_end.get(token)
            if may_end is None:
                text = self.decode([token])
                may_end = self._may_end[token] = any(c in text for c in self.lasts)
            if not may_end:
                return False
        window = tokens[-self.window:]
        if len(window) < self.window and context:
            window = list(context[len(window) - self.window:]) + window
        tail = self.decode(window)
        kept = len(os.path.commonprefix([self.decode(window[:-1]), tail]))  # the text before the last token's
        return any(tail.find(s, max(0, kept - len(s) + 1)) >= 0 for s in self.strings)


def stop_context(request) -> list[int]:
    """The tokens of `request`'s prompt that its stop strings read as text the completion continues."""
    return request.prompt_ids[len(request.prompt_ids) - request.stop_context:] if request.stop_context else []
