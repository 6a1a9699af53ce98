"""Newline step splitter: one step per line.

``newline_step_starts(text)`` returns the character offsets where steps start.
A ``\\n`` starts the next step (the newline belongs to the step it opens, as
in the LaTeX splitter). A step holding only whitespace (a blank line) is glued
to the next step, or to the previous one when it is last, so trailing newlines
never form their own step. Steps ``text[s_i:s_{i+1}]`` tile the text exactly;
empty text gives ``[]`` and any other text at least ``[0]``.
"""

from __future__ import annotations


def newline_step_starts(text: str) -> list[int]:
    """Character offsets where lines start, blank lines glued forward."""
    if not text:
        return []
    cuts = [i for i, ch in enumerate(text) if ch == "\n" and i > 0]
    bounds = [0] + cuts + [len(text)]
    starts: list[int] = []
    pending = None  # start of a run of blank lines waiting for a non-blank line
    for a, b in zip(bounds, bounds[1:]):
        pending = a if pending is None else pending
        if text[a:b].strip():
            starts.append(pending)
            pending = None
    if pending is not None and not starts:
        starts.append(pending)  # the whole text is blank: one step
    return starts
