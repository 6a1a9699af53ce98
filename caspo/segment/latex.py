"""LaTeX-aware step splitter (VinePPO's in-place splitter, rebuilt from its rules).

``latex_step_starts(text)`` returns the character offsets where reasoning steps
start. Steps are ``text[s_i:s_{i+1}]`` (the last one runs to the end), so they
tile the text exactly: the splitter only chooses cut positions, it never
rewrites text. Empty text gives ``[]``; any other text gives at least ``[0]``.

Five stages: mask math, cut sentences and lines, cut after period-closed math,
cut rows of display math, halve long pieces. docs/segment.md states every rule,
the constants below, and where this splitter differs from upstream.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from itertools import chain

MATH_MASK_LEN = 60  # masked math counts as this many characters
SHORT_MASKED = 20  # stage 2: shorter pieces not ending in "." are glued forward
SHORT_REAL = 20  # stage 3: shorter pieces without a period-closed math ending are glued
TINY = 3  # stage 4: shorter pieces are glued forward
LONG = 100  # stage 5: longer pieces are halved
LANG_MIN_HALF = 40
RAW_MIN_HALF = 20

MATH_PATTERNS = [
    re.compile(p, re.DOTALL)
    for p in (
        r"\[asy\].*?\[/asy\]",
        r"\$\\begin\{tabular\}.*?\\end\{tabular\}\$|\\begin\{tabular\}.*?\\end\{tabular\}",
        r"\\\(.*?\\\)",
        r"\\\[.*?\\\]",
        r"\$\$.+?\$\$",
        r"(?<!\\)\$(?!\$).+?(?<!\\)\$(?!\$)",
        r"\\begin\{([^{}]+)\}.*?\\end\{\1\}",
    )
]
PERIOD_MATH_ENDINGS = (".$", ".$$", ".\\)", ".\\]")
NEWLINE = re.compile("\n")
SENTENCE_END = re.compile(r"\.(?=\s+[A-Z])")
OPENERS_ONLY = re.compile(
    r"\s*(?:(?:\$\$?|\\\(|\\\[|\\begin\{[^{}]*\}(?:\{[^{}]*\})?|\[asy\])\s*)+"
)
LANGUAGE_SEPARATORS = (",", " and ", ":", " to ")  # in priority order
RAW_SEPARATORS = (",$", ",\\)", ",\\]", "=", "\\equiv", "+", "\\cancelto")


def latex_step_starts(text: str) -> list[int]:
    """Character offsets where steps start; ``[]`` for empty text."""
    if not text:
        return []
    sentinel = _unused_char(text)
    spans = mask_math(text, sentinel)
    starts = _sentences_and_lines(text, spans, sentinel)
    starts = _period_math_cuts(text, spans, starts)
    starts = _math_newline_cuts(text, spans, starts)
    return _halve_long(text, spans, sentinel, starts)


# ---------------------------------------------------------------- masking


def _unused_char(text: str) -> str:
    """A private-use character that does not occur in ``text``."""
    for code in chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE)):
        if chr(code) not in text:
            return chr(code)
    raise ValueError("text uses every private-use character")


def masked_view(text, spans, a, b, sentinel):
    """``text[a:b]`` with each (clipped) math span replaced by 60 sentinels.

    Returns the masked string and, per masked character, its offset in ``text``
    (a span's sentinels all map to the span start).
    """
    parts, origin, pos = [], [], a
    first = max(bisect_left(spans, (a, a)) - 1, 0)
    for s, e in spans[first:]:
        s, e = max(s, a), min(e, b)
        if s >= b:
            break
        if s >= e:
            continue
        parts += [text[pos:s], sentinel * MATH_MASK_LEN]
        origin += list(range(pos, s)) + [s] * MATH_MASK_LEN
        pos = e
    parts.append(text[pos:b])
    origin += range(pos, b)
    return "".join(parts), origin


def mask_math(text: str, sentinel: str) -> list[tuple[int, int]]:
    """Sorted, disjoint ``(start, end)`` math spans, patterns applied in priority order."""
    spans: list[tuple[int, int]] = []
    for pattern in MATH_PATTERNS:
        masked, origin = masked_view(text, spans, 0, len(text), sentinel)
        found = [(origin[m.start()], origin[m.end() - 1] + 1) for m in pattern.finditer(masked)]
        if not found:
            continue
        # a new span starts and ends on a real delimiter, so old spans are inside or outside it
        outside = [sp for sp in spans if not any(s <= sp[0] and sp[1] <= e for s, e in found)]
        spans = sorted(outside + found)
    return spans


# ---------------------------------------------------------------- helpers


def _pieces(starts, n):
    return list(zip(starts, starts[1:] + [n]))


def _glue(pieces, is_weak, backward_last):
    """Merge each weak piece into the next; a weak last piece into the previous one."""
    out, start = [], None
    for a, b in pieces:
        start = a if start is None else start
        if not is_weak(start, b):
            out.append((start, b))
            start = None
    if start is not None:
        end = pieces[-1][1]
        if out and backward_last:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return [a for a, _ in out]


def _cut(starts, cuts, n):
    return sorted(set(starts) | {c for c in cuts if 0 < c < n})


def _short_word_before(masked: str, p: int) -> bool:
    """True when the word ending at ``masked[p-1]`` is one letter, or two letters after whitespace."""

    def letter(i):
        return i >= 0 and masked[i].isascii() and masked[i].isalpha()

    if not letter(p - 1):
        return False
    if not letter(p - 2):
        return True
    return not letter(p - 3) and (p - 3 < 0 or masked[p - 3].isspace())


# ---------------------------------------------------------------- stages


def _sentences_and_lines(text, spans, sentinel):
    masked, origin = masked_view(text, spans, 0, len(text), sentinel)
    cuts = {m.start() for m in NEWLINE.finditer(masked)}
    cuts |= {m.end() for m in SENTENCE_END.finditer(masked) if not _short_word_before(masked, m.start())}
    starts = _cut([0], cuts, len(masked))

    def weak(a, b):
        piece = masked[a:b]
        return not piece.strip() or (len(piece) < SHORT_MASKED and not piece.endswith("."))

    starts = _glue(_pieces(starts, len(masked)), weak, backward_last=False)
    return [origin[s] for s in starts]


def _period_math_cuts(text, spans, starts):
    cuts = [e for s, e in spans if text[s:e].endswith(PERIOD_MATH_ENDINGS)]
    starts = _cut(starts, cuts, len(text))

    def weak(a, b):
        return b - a < SHORT_REAL and not text[a:b].endswith(PERIOD_MATH_ENDINGS)

    return _glue(_pieces(starts, len(text)), weak, backward_last=True)


def _math_newline_cuts(text, spans, starts):
    cuts = [m.start() for s, e in spans for m in NEWLINE.finditer(text, s + 1, e)]
    starts = _cut(starts, cuts, len(text))

    def weak(a, b):
        return b - a < TINY or OPENERS_ONLY.fullmatch(text, a, b) is not None

    return _glue(_pieces(starts, len(text)), weak, backward_last=True)


def _halve_long(text, spans, sentinel, starts):
    out: list[int] = []
    for a, b in _pieces(starts, len(text)):
        _halve(text, spans, sentinel, a, b, out)
    return out


def _halve(text, spans, sentinel, a, b, out):
    cut = _language_cut(text, spans, sentinel, a, b) if b - a > LONG else None
    if cut is None and b - a > LONG:
        cut = _nearest_cut(text[a:b], RAW_SEPARATORS, RAW_MIN_HALF)
        cut = None if cut is None else a + cut
    if cut is None:
        out.append(a)
        return
    _halve(text, spans, sentinel, a, cut, out)
    _halve(text, spans, sentinel, cut, b, out)


def _language_cut(text, spans, sentinel, a, b):
    masked, origin = masked_view(text, spans, a, b, sentinel)
    for sep in LANGUAGE_SEPARATORS:
        cut = _nearest_cut(masked, (sep,), LANG_MIN_HALF)
        if cut is not None:
            return origin[cut - 1] + 1  # the separator's last character is real text
    return None


def _nearest_cut(s: str, separators, min_half: int):
    """Offset right after a separator, both halves >= ``min_half``, nearest the middle."""
    best = None
    for sep in separators:
        i = s.find(sep)
        while i >= 0:
            cut = i + len(sep)
            if min_half <= cut <= len(s) - min_half:
                if best is None or (abs(2 * cut - len(s)), cut) < (abs(2 * best - len(s)), best):
                    best = cut
            i = s.find(sep, i + 1)
    return best
