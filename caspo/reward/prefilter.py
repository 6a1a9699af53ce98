"""Answers refused (reward 0) before math-verify sees them: too costly to verify, or hedged.

math-verify's alarms bound a call's time, but not what it costs in that time: a megabyte inside a
box, `2^{300000007}`, `\\binom{10^6}{5 \\cdot 10^5}` or ten nested parentheses each spend seconds
(and `2^{300000007}` hundreds of megabytes) before the alarm fires. No correct final answer of a
math problem looks like that, so the verifier refuses them at once. The rule, on the extracted
answer (docs/reliability.md, "Verifier"):

1. length: more than `max_chars` characters (reward.max_answer_chars, default MAX_ANSWER_CHARS);
2. nesting: brackets (`{`, `(`, `[`, `\\{`) nested more than MAX_NESTING deep;
3. power tower: powers stacked more than MAX_TOWER_HEIGHT high (`a^{b^{c}}` passes,
   `a^{b^{c^{d}}}` does not); `\\exp` counts as a power of e;
4. magnitude: an upper bound of the value of some part of the answer has more than MAX_DIGITS
   decimal digits. The bound reads the answer left to right: a number is its value (ASCII digits;
   groups of three after a `,` `{,}` `\\,` `\\!` `\\;` `\\ ` `~` or space are thousands; at least 2),
   any letter or command is 2, a bracket group and every run of factors is the product of its
   parts (an upper bound for sums too, as every part is >= 2), `a^b` is a ** b, `n!` is n ** n,
   `\\binom{n}{k}` and `\\Gamma(n)` are n ** n (their cost is that of n!), and a subscript
   (`_{...}`) adds nothing. Without braces, `^` takes the digits that follow it, without
   separators (`2^34` is 2^{34}, `2^3,400` is 2^3 and 400), as math-verify reads it.
   `2^{100000}` (30,103 digits) passes; `2^{1000000}`, `10^{10^{10}}`, `9^{9^{9}}`, `(10^5)!`
   and `\\binom{100000}{50000}` do not;
5. symbolic power: a bracket group containing a letter or command raised to a power whose bound
   exceeds MAX_SYMBOLIC_EXPONENT: `(x+1)^{1000}` (math-verify expands it, for seconds) does not
   pass, `x^{1000}` and `(x+1)^{100}` do.

`hedged` refuses answers that join candidates with a connective after which math-verify keeps
only the right-hand side (`41 \\lor 42`, `41 \\to 42`, `41 \\\\ 42` all read as 42 and would score
against 42): the commands in HEDGE_COMMANDS, `||`, a single `|` between two numbers (`41 | 42`;
an odd count of `|`, so not an absolute value), `\\circ` other than a degree sign (`^\\circ`),
a line break `\\\\` outside a matrix or array, and a text group holding a comma or a parenthesis
beside other content (`41 \\text{ (or } 42)`), unless it is a unit in parentheses ending the answer, the
answer's only text group, of words none of which is "or" or "and" (`12 \\text{ (cm)}`, which math-verify reads
as 12). Candidates math-verify reads as a set (`41, 42`, `41 \\text{ or } 42`, `42 \\pm 1`) need no rule: a set
never equals a number.
"""

import math
import re
from typing import NamedTuple

MAX_ANSWER_CHARS = 300  # typical boxed answers on math benchmarks are under 100 characters
MAX_NESTING = 8  # math-verify takes ~0.5 s at 8 nested parentheses and seconds at 12
MAX_TOWER_HEIGHT = 2
MAX_DIGITS = 100_000
MAX_SYMBOLIC_EXPONENT = 100  # (x+1)^{100} takes ~0.4 s, (x+1)^{1000} the whole timeout

HEDGE_COMMANDS = ("lor", "vee", "land", "wedge", "mid", "to", "rightarrow", "longrightarrow", "Rightarrow",
                  "Longrightarrow", "implies", "iff", "Leftrightarrow", "leftrightarrow", "Longleftrightarrow",
                  "mapsto", "sim", "therefore", "because", "ni", "parallel", "setminus", "vdash", "perp", "cap",
                  "oplus", "colon")
_HEDGE = re.compile(rf"\\(?:{'|'.join(HEDGE_COMMANDS)})(?![A-Za-z])|\|\|")
_CIRC = re.compile(r"\\circ(?![A-Za-z])")
_MATRIX = re.compile(r"\\begin\{((?:[pbvVB]|small)?matrix|array)\}.*?\\end\{\1\}", re.DOTALL)
_TEXT_GROUP = r"\\(?:text|textbf|textit|textrm|mbox|mathrm)\s*\{"
_TEXT_WITH_PUNCTUATION = re.compile(_TEXT_GROUP + r"([^{}]*[(),][^{}]*)\}")
# A unit in parentheses at the end of the answer (`12 \text{ (cm)}`): words only, none of them "or" or "and".
_UNIT_IN_PARENTHESES = re.compile(r"\s*\(\s*[A-Za-z][A-Za-z ]*\)\s*")
_OR_AND = re.compile(r"\b(?:or|and)\b", re.IGNORECASE)

_SEPARATOR = r"(?:\{,\}|\\[,!; ]|[,~ ])"
_TOKEN = re.compile(
    r"(?P<digit_power>\^\s*[0-9]+)"  # as latex2sympy reads it: 2^34 is 2^{34}, 2^3,4 is 2^3 and 4
    rf"|(?P<num>[0-9]{{1,3}}(?:{_SEPARATOR}[0-9]{{3}})+(?![0-9])|[0-9]+)"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<open>\\\{|[{(\[])"
    r"|(?P<close>\\\}|[})\]])"
    r"|(?P<pow>\^|\*\*)"
    r"|(?P<fact>!)"
    r"|(?P<sub>_)"
    r"|(?P<sym>[A-Za-z])"
    r"|(?P<esc>\\.)"
)
# Commands that are layout only (no factor); and commands that add no factor of their own but make
# their group symbolic for rule 5 (an irrational root expands like a letter).
_LAYOUT = {"left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr", "frac", "dfrac",
           "tfrac", "cfrac", "cdot", "times", "div", "quad", "qquad", "displaystyle", "text", "textbf", "mathrm",
           "mathbf", "mbox", "operatorname"}
_ROOTS = {"sqrt"}
_FACTORIAL_LIKE = {"binom", "dbinom", "tbinom", "choose", "Gamma"}  # cost like n!
_LOG2 = math.log10(2)




class _TooCostly(Exception):
    pass


def too_costly(answer: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """Why `answer` is refused before verification (see the module docstring), or None."""
    if len(answer) > max_chars:
        return f"longer than {max_chars} characters"
    try:
        _read(answer)
    except _TooCostly as why:
        return str(why)
    return None


def hedged(answer: str) -> str | None:
    """Why `answer` is refused as a hedge (see the module docstring), or None."""
    found = _HEDGE.search(answer)
    if found:
        return f"a hedge: {found.group(0)} (math-verify would keep only its right-hand side)"
    for circ in _CIRC.finditer(answer):
        if not re.search(r"\^\s*\{?\s*$", answer[:circ.start()]):
            return "a hedge: \\circ that is not a degree sign"
    if "\\\\" in _MATRIX.sub(" ", answer):
        return "a hedge: a line break outside a matrix"
    if answer.count("|") % 2 and re.search(r"[0-9]\s*\|\s*-?[0-9]", answer):
        return "a hedge: | between two numbers (math-verify would keep only its right-hand side)"
    answer = answer.strip()
    for text in _TEXT_WITH_PUNCTUATION.finditer(answer):
        if text.group(0) != answer and not _unit_at_the_end(answer, text):
            return "a hedge: a text group with a comma or a parenthesis beside other content"
    return None


def _unit_at_the_end(answer: str, text: re.Match) -> bool:
    """Whether a text group is a unit in parentheses ending the answer (`12 \\text{ (cm)}`), which math-verify
    drops: no digit, comma or "or"/"and" that could join a second candidate, and no text group before it
    (math-verify would drop everything from that one on: `41 \\text{ then } 42 \\text{ (cm)}` reads as 41)."""
    return (text.end() == len(answer) and _UNIT_IN_PARENTHESES.fullmatch(text.group(1)) is not None
            and not _OR_AND.search(text.group(1)) and re.search(_TEXT_GROUP, answer[:text.start()]) is None)


class _Factor(NamedTuple):
    log: float  # log10 of an upper bound of its value
    height: int  # powers stacked in it
    symbolic_group: bool = False  # a bracket group with a letter or command inside


class _Frame:
    """One bracket group being read: the bound of its product so far, and its last factor."""

    def __init__(self):
        self.total = 0.0  # log10 bound of the product of its factors, the last one included
        self.last: _Factor | None = None
        self.height = 0
        self.symbolic = False
        self.pending: str | None = None  # "pow", "sub" or "binom": what the next factor is for
        # (base, exponent) when the last factor is a power, so that a "^" right after it stacks
        # on the exponent: a^b^c = a^(b^c)
        self.power: tuple[_Factor, _Factor] | None = None

    def add(self, factor: _Factor) -> None:
        pending, self.pending = self.pending, None
        if pending == "sub":
            return
        if pending == "binom":
            factor = factor._replace(log=_log10_factorial(factor.log))
        if pending == "pow" and self.last is not None:
            if self.power is not None:  # a^b^c
                base, exponent = self.power[0], _power(*self.power[1:], factor)
            else:
                base, exponent = self.last, factor
            self.replace_last(_power(base, exponent), (base, exponent))
            return
        _check(factor.log)
        self.total += factor.log
        self.last, self.power = factor, None
        self.height = max(self.height, factor.height)
        _check(self.total)

    def replace_last(self, factor: _Factor, power: tuple[_Factor, _Factor] | None = None) -> None:
        _check(factor.log)
        self.total += factor.log - self.last.log
        self.last, self.power = factor, power
        self.height = max(self.height, factor.height)
        _check(self.total)

    def closed(self) -> _Factor:
        return _Factor(self.total, self.height, self.symbolic)


def _read(answer: str) -> None:
    stack = [_Frame()]
    for token in _TOKEN.finditer(answer):
        kind, text = token.lastgroup, token.group(0)
        frame = stack[-1]
        if kind == "num":
            frame.add(_Factor(_log10_int(re.sub(r"[^0-9]", "", text)), 0))
        elif kind == "digit_power" and frame.last is not None and frame.pending is None:
            frame.pending = "pow"
            frame.add(_Factor(_log10_int(text.lstrip("^ \t\n")), 0))
        elif kind in ("sym", "esc"):
            frame.symbolic |= kind == "sym"
            frame.add(_Factor(_LOG2, 0))
        elif kind == "cmd":
            name = text[1:]
            if name == "exp":  # e^(...)
                frame.symbolic = True
                frame.add(_Factor(_LOG2, 0))
                frame.pending = "pow"
            elif name == "uparrow":
                frame.pending = "pow"
            elif name in _FACTORIAL_LIKE:
                frame.pending = "binom"
            elif name in _ROOTS:
                frame.symbolic = True
            elif name not in _LAYOUT:
                frame.symbolic = True
                frame.add(_Factor(_LOG2, 0))
        elif kind == "open":
            if len(stack) > MAX_NESTING:
                raise _TooCostly(f"brackets nested more than {MAX_NESTING} deep")
            stack.append(_Frame())
        elif kind == "close" and len(stack) > 1:
            group = stack.pop()
            stack[-1].symbolic |= group.symbolic
            stack[-1].add(group.closed())
        elif kind == "pow" and frame.last is not None and frame.pending is None:
            frame.pending = "pow"
        elif kind == "fact" and frame.last is not None and frame.pending is None:
            frame.replace_last(frame.last._replace(log=_log10_factorial(frame.last.log)))
        elif kind == "sub" and frame.pending is None:
            frame.pending = "sub"
    while len(stack) > 1:  # unclosed groups end with the answer
        group = stack.pop()
        stack[-1].add(group.closed())


def _power(base: _Factor, exponent: _Factor) -> _Factor:
    height = max(base.height, exponent.height + 1)
    if height > MAX_TOWER_HEIGHT:
        raise _TooCostly(f"a power tower more than {MAX_TOWER_HEIGHT} high")
    if base.symbolic_group and exponent.log > math.log10(MAX_SYMBOLIC_EXPONENT):
        raise _TooCostly(f"a bracket group with letters raised to a power above {MAX_SYMBOLIC_EXPONENT}")
    return _Factor(base.log * _value(exponent.log), height)


def _check(log: float) -> None:
    if log > MAX_DIGITS:
        raise _TooCostly(f"a number of more than {MAX_DIGITS} digits")


def _log10_int(digits: str) -> float:
    """log10 of a non-negative integer written in ASCII digits, at least log10(2)."""
    digits = digits.lstrip("0") or "0"
    return max(math.log10(max(int(digits[:17]), 2)) + max(0, len(digits) - 17), _LOG2)


def _value(log: float) -> float:
    return 10.0 ** log if log < 300 else math.inf


def _log10_factorial(log: float) -> float:
    """log10 of n ** n >= n!, for n = 10 ** log."""
    return _value(log) * log
