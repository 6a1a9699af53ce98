"""LaTeX-aware step splitter: upstream VinePPO's in-place splitter, rule for rule.

``latex_step_starts(text)`` returns the character offsets where reasoning steps
start. Steps are ``text[s_i:s_{i+1}]`` (the last one runs to the end), so they
tile the text exactly: the splitter only chooses cut positions, it never
rewrites text. Empty text gives ``[]``; any other text gives at least ``[0]``.

On every text that upstream's ``split_solution_inplace``
(McGill-NLP/VinePPO, ``src/treetune/tasks/math_extract_steps_inplace.py``)
splits, the starts are upstream's. Five stages: mask math, cut sentences and
lines, cut after period-closed math, cut rows of display math, halve long
pieces. docs/segment.md states every rule, the texts upstream fails on, and
what this splitter returns for them.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from itertools import chain
from typing import Callable, Iterator

MASK_LEN = 60  # a masked math span counts as this many characters (upstream's placeholder length)
SHORT_MASKED = 20  # stage 2: shorter pieces not ending in "." are glued forward
SHORT_REAL = 20  # stage 3: shorter pieces without a period-closed math ending are glued
TINY = 3  # stage 4: shorter pieces are glued
LONG = 100  # stage 5: longer pieces are halved
LANG_MIN_HALF = 40  # stage 5: least real length of each half at a language cut
RAW_MIN_HALF = 20  # stage 5: least length of each half at a raw cut

# one pass each, in this order; a later pass sees earlier matches as opaque runs
MATH_PATTERNS = [
    re.compile(p, re.DOTALL)
    for p in (
        r"\[asy\].*?\[/asy\]",
        r"\$\\begin\{tabular\}.*?\\end\{tabular\}\$",
        r"\\begin\{tabular\}.*?\\end\{tabular\}",
        r"\\\(.*?\\\)",
        r"\\\[.*?\\\]",
        r"\$\$.*?\$\$",
        r"(?<!\\)\$.*?[^\\]\$(?!\$)",
        r"\\begin\{([^}]*)\}.*?\\end\{\1\}",
    )
]
PERIOD_MATH_ENDINGS = (".$", ".$$", ".\\)", ".\\]")
# a period then whitespace and a capital, unless the word before the period is one letter
# (x., e.g.) or two letters after whitespace (Mr.)
SENTENCE_END = re.compile(r"(?<=\.)(?<!\b[A-Za-z]\.)(?<!\s[A-Za-z]{2}\.)(?=\s+[A-Z])")
NEWLINE = re.compile("\n")
SINGLE_OPENER = re.compile(r"\$\$?|\\\(|\\\[|\\begin\{[^}]*\}|\[asy\]")
# (regex, characters after the cut that stay with the next piece), in priority order
LANGUAGE_SEPARATORS = [(re.compile(","), 0), (re.compile(r"\sand\s"), 1), (re.compile(":"), 0),
                       (re.compile(r"\sto\s"), 1)]
RAW_SEPARATORS = [re.compile(re.escape(s)) for s in (",$", ",\\)", ",\\]", "=", "\\equiv", "+", "\\cancelto")]


def latex_step_starts(text: str) -> list[int]:
    """Character offsets where steps start; ``[]`` for empty text."""
    if not text:
        return []
    view = MaskedText(text)
    starts = _sentences_and_lines(view)
    starts = _period_math_cuts(view, starts)
    if starts is not None:
        starts = _math_row_cuts(view, starts)
    if starts is None:  # too short to make one valid step: upstream fails, here it is one step
        return [0]
    return _halve_long(text, starts)


# ---------------------------------------------------------------- masking


class MaskedText:
    """``text`` with its top-level math spans masked, as upstream's placeholders mask them.

    Each span shows as ``MASK_LEN`` copies of one private-use character chosen
    per distinct span content (equal math, equal mask, as upstream's hashed
    placeholders). A later match that contains earlier spans (``$x$`` inside
    ``align*``) absorbs them; upstream fails on such text.
    """

    def __init__(self, text: str):
        self.text = text
        keys: dict[str, str] = {}
        free = _unused_chars(text)
        self._render([])
        for pattern in MATH_PATTERNS:
            found = []
            for m in pattern.finditer(self.masked):  # matches start and end on real delimiters
                if m.group(0) not in keys:
                    keys[m.group(0)] = next(free, None) or _out_of_chars()
                ch = keys[m.group(0)]
                found.append((self.to_real(m.start()), self.to_real(m.end() - 1) + 1, ch))
            if found:
                found_starts = [s for s, _, _ in found]
                outside = [sp for sp in self.spans if not _covered(sp, found, found_starts)]
                self._render(sorted(outside + found))

    def _render(self, spans: list[tuple[int, int, str]]):
        """Build ``masked`` from the real ``(start, end, mask character)`` spans."""
        parts, self.mstarts, pos, shift = [], [], 0, 0
        for s, e, ch in spans:
            parts += [self.text[pos:s], ch * MASK_LEN]
            self.mstarts.append(s - shift)
            shift += e - s - MASK_LEN
            pos = e
        parts.append(self.text[pos:])
        self.masked, self.spans = "".join(parts), spans

    def to_real(self, d: int) -> int:
        """Offset in ``text`` of masked offset ``d`` (a span's mask maps to its start)."""
        k = bisect_right(self.mstarts, d) - 1
        if k < 0:
            return d
        s, e, _ = self.spans[k]
        return s if d < self.mstarts[k] + MASK_LEN else e + d - self.mstarts[k] - MASK_LEN


def _covered(span, found, found_starts) -> bool:
    """Whether ``span`` lies inside one of the sorted, disjoint ``found`` spans (starting at ``found_starts``)."""
    k = bisect_right(found_starts, span[0]) - 1
    return k >= 0 and found[k][1] >= span[1]


def _unused_chars(text: str) -> Iterator[str]:
    return (chr(c) for c in chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE)) if chr(c) not in text)


def _out_of_chars():
    raise ValueError("too many distinct math spans for the private-use characters the text leaves free; "
                     "use method.step_splitter=newline")


# ---------------------------------------------------------------- helpers


def _pieces(starts, n):
    return list(zip(starts, starts[1:] + [n]))


def _glue(pieces, is_weak: Callable[[int, int], bool], backward_last: bool) -> list[int] | None:
    """Merge each weak piece into the next, rechecking the merged piece; a weak last piece into the previous.

    Returns the starts, or None when backward gluing has no previous piece
    (the whole text is one weak piece: upstream fails there).
    """
    out, start = [], None
    for a, b in pieces:
        start = a if start is None else start
        if not is_weak(start, b):
            out.append((start, b))
            start = None
    if start is not None:
        if backward_last:
            if not out:
                return None
            out[-1] = (out[-1][0], pieces[-1][1])
        else:
            out.append((start, pieces[-1][1]))
    return [a for a, _ in out]


# ---------------------------------------------------------------- stages


def _sentences_and_lines(view: MaskedText) -> list[int]:
    """Cut after sentence ends and before newlines outside math; glue short pieces forward (masked lengths)."""
    masked = view.masked
    cuts = {m.start() for m in SENTENCE_END.finditer(masked)} | {m.start() for m in NEWLINE.finditer(masked)}
    starts = sorted(cuts | {0})

    def weak(a, b):
        return b - a < SHORT_MASKED and not masked[a:b].endswith(".")

    return [view.to_real(s) for s in _glue(_pieces(starts, len(masked)), weak, backward_last=False)]


def _period_math_cuts(view: MaskedText, starts: list[int]) -> list[int] | None:
    """Cut after math ending in a period; glue pieces under 20 characters without such an ending."""
    text = view.text
    cuts = {e for s, e, _ in view.spans if text[s:e].endswith(PERIOD_MATH_ENDINGS)}
    starts = sorted(set(starts) | (cuts - {len(text)}))

    def weak(a, b):
        return b - a < SHORT_REAL and not text[a:b].endswith(PERIOD_MATH_ENDINGS)

    return _glue(_pieces(starts, len(text)), weak, backward_last=True)


def _math_row_cuts(view: MaskedText, starts: list[int]) -> list[int] | None:
    """Cut before newlines inside math (once per distinct math of a piece); glue lone openers and tiny pieces."""
    text, cuts, seen = view.text, set(), set()
    for s, e, ch in view.spans:
        piece = bisect_right(starts, s) - 1
        if (piece, ch) not in seen:  # upstream unmasks equal math of a piece all at once, so cuts it once
            seen.add((piece, ch))
            cuts |= {m.start() for m in NEWLINE.finditer(text, s + 1, e)}
    starts = sorted(set(starts) | cuts)

    def weak(a, b):
        return b - a < TINY or SINGLE_OPENER.fullmatch(text[a:b].strip()) is not None

    return _glue(_pieces(starts, len(text)), weak, backward_last=True)


def _halve_long(text: str, starts: list[int]) -> list[int]:
    out: list[int] = []
    for a, b in _pieces(starts, len(text)):
        out += [a + c for c in (_break_long(text[a:b]) if b - a > LONG else [0])]
    return out


def _break_long(part: str) -> list[int]:
    """Starts of ``part`` halved at language, else raw cuts, while a piece is over ``LONG`` characters.

    After a raw cut, pieces starting in [lo, hi) skip language cuts. As
    upstream, lo is the raw cut and hi the length of the piece it was found in,
    both relative to that piece, not to ``part``.
    """
    bounds, lo, hi = [0, len(part)], None, 0
    i = 0
    while i < len(bounds) - 1:
        a, b = bounds[i], bounds[i + 1]
        cut = None
        if b - a > LONG:
            sub = part[a:b]
            if lo is None or not lo <= a < hi:
                cut = _language_cut(sub)
            if cut is None:
                cut = _raw_cut(sub)
                if cut is not None:
                    lo, hi = (cut if lo is None else min(lo, cut)), max(hi, len(sub))
        if cut is None:
            i += 1
        else:
            bounds.insert(i + 1, a + cut)
    return bounds[:-1]


def _nearest_middle(cuts: list[int], n: int) -> int:
    return min(cuts, key=lambda c: abs(2 * c - n))  # ties: the earlier cut


def _language_cut(sub: str) -> int | None:
    """Cut after the first kind of separator whose cut nearest the middle (masked) leaves 40 real characters a side."""
    view = MaskedText(sub)  # masked afresh, as upstream does for each long piece
    for pattern, keep in LANGUAGE_SEPARATORS:
        cuts = [m.end() - keep for m in pattern.finditer(view.masked)]
        if cuts:
            cut = view.to_real(_nearest_middle(cuts, len(view.masked)))
            if min(cut, len(sub) - cut) >= LANG_MIN_HALF:
                return cut
    return None


def _raw_cut(sub: str) -> int | None:
    """Cut after the first kind of raw separator whose cut nearest the middle leaves 20 characters a side."""
    for pattern in RAW_SEPARATORS:
        cuts = [m.end() for m in pattern.finditer(sub)]
        if cuts:
            cut = _nearest_middle(cuts, len(sub))
            if min(cut, len(sub) - cut) >= RAW_MIN_HALF:
                return cut
    return None
