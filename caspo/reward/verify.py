"""Final-answer reward: 1.0 if the response's final answer equals the gold label, else 0.0.

The answer is extracted first (caspo.reward.extract: the last box by default) and checked by the
pre-filter (caspo.reward.prefilter); only then is it handed to math-verify, wrapped as
`$\\boxed{...}$`, because math-verify merges two nearby boxes into a set, and parsed as that box
alone; an answer that equates numbers that differ scores 0 (docs/reliability.md, "Hedges"). Golds
are wrapped as `$...$`: a bare `\\frac12` parses to nothing. Text labels (caspo.reward.labels) are compared as
normalized strings, never by math-verify.

The reward workers import this module, so it imports only the standard library, math-verify and
caspo.reward's own light modules (never torch).
"""

import math
import re
import threading
from collections.abc import Sequence
from functools import lru_cache
from importlib.metadata import version
from itertools import product
from typing import NamedTuple

from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException
from sympy import And, Basic, Eq

from caspo.reward.extract import extract_answer
from caspo.reward.labels import blank_text_label, letter_word, same_text, text_label
from caspo.reward.prefilter import MAX_ANSWER_CHARS, hedged, too_costly

# Names this verifier and the libraries that decide its verdicts; bump the first part
# whenever extraction or scoring changes, so results can be traced to the code that made them.
VERIFIER_VERSION = (
    "caspo-final-answer-4"
    f"+math-verify-{version('math-verify')}"
    f"+latex2sympy2_extended-{version('latex2sympy2_extended')}"
)

# Parse a box (or a gold) as a whole, or keep its text: math-verify's defaults go on, when it does not parse,
# to the rightmost plain expression inside it, so `41 ? 42` and `1, 2, \\dots, 42` would read as 42.
_LATEX_ONLY = [LatexExtractionConfig()]
# `\\frac\\pi4` is TeX for \\frac{\\pi}{4} (an argument without braces is one token), which math-verify misreads
# (`\\frac{\\}{p}i4`) where the token is a command: such arguments get their braces first. Commands that take
# arguments of their own (`\\frac\\sqrt{2}{2}`) are left alone.
_FRAC = re.compile(r"\\[dt]?frac(?![A-Za-z])")
_TOKEN = re.compile(r"\s*(\\[A-Za-z]+|[0-9A-Za-z])")
_TAKES_ARGUMENTS = {"sqrt", "frac", "dfrac", "tfrac", "cfrac", "text", "textbf", "textit", "textrm", "mathrm", "mathbf",
                    "mbox", "operatorname", "overline", "bar", "hat", "vec", "boxed", "binom", "left", "right"}
_INTEGER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)")  # ASCII digits only
# A label that is one formula ending a sentence (`$h=4$.`, as College Math writes some).
_FORMULA_AND_PERIOD = re.compile(r"\$([^$]+)\$\s*\.")
# A LaTeX space (`\,`, `\:`, `\;`, `\ `, `\!`, `~`) between thousands groups: "1\,000" is 1000 (math-verify
# reads 1*0).
_DIGIT_GROUP_SPACE = re.compile(r"(?<=[0-9])(?:\\[,:; !]|~)(?=[0-9]{3}(?![0-9]))")


class Verdict(NamedTuple):
    """A response's reward, and whether math-verify's alarm ended one of its steps (then the reward is 0 for
    want of a verdict, not because the answer is wrong)."""

    reward: float
    timed_out: bool = False


def score(response: str, label: str, finished: bool = True, timeout_s: float | None = 5.0, *,
          extractor: str = "boxed", fallback: str = "none", max_answer_chars: int = MAX_ANSWER_CHARS) -> float:
    """Reward of one response: 1.0 if its final answer matches `label`, else 0.0 (`judge`'s reward)."""
    return judge(response, label, finished, timeout_s, extractor=extractor, fallback=fallback,
                 max_answer_chars=max_answer_chars).reward


def judge(response: str, label: str, finished: bool = True, timeout_s: float | None = 5.0, *,
          extractor: str = "boxed", fallback: str = "none", max_answer_chars: int = MAX_ANSWER_CHARS) -> Verdict:
    """Reward of one response (1.0 if its final answer matches `label`, else 0.0), and whether it timed out.

    A response cut off by the length limit (finished=False) scores 0 whatever it says, and so
    does one without an answer (caspo.reward.extract.extract_answer with `extractor`, `fallback`)
    or whose answer the pre-filter refuses as too costly (`max_answer_chars` and the rest of
    caspo.reward.prefilter.too_costly) or, against a math label, as a hedge (prefilter.hedged).
    Never raises on model output: any failure to extract, parse or compare scores 0.

    timeout_s bounds each math-verify step (parsing the gold, parsing the answer, each
    comparison). math-verify enforces it with SIGALRM, in whole seconds, so it only works in
    the main thread; calling from another thread raises RuntimeError instead of silently
    scoring 0. timeout_s=None switches the alarms off (any thread, but no time limit). A step
    its alarm ends scores 0 with `timed_out` set, so that callers can count it.
    """
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}: {label!r}")
    if timeout_s is not None:
        _require_main_thread()
    if not finished:
        return Verdict(0.0)
    answer = extract_answer(response, extractor, fallback)  # raises only on an unknown option
    if answer is None or too_costly(answer, max_answer_chars):
        return Verdict(0.0)
    gold = _strip_dollars(label)
    if text_label(gold) or letter_word(gold):
        return Verdict(1.0 if same_text(answer, gold) else 0.0)
    if hedged(answer):
        return Verdict(0.0)
    try:
        answer = _normalized(answer)
        fast = _integer_verdict(answer, gold)
        if fast is not None:
            return Verdict(fast)
        seconds = _alarm_seconds(timeout_s)
        parsed_gold = _parse_gold(_normalized(gold), seconds)
        # Unescaped "$" inside the box ("\boxed{$18$}") would close the math environment early.
        answer = re.sub(r"(?<!\\)\$", "", answer)
        prediction = _parse("$\\boxed{" + answer + "}$", seconds)
        if not _equal(parsed_gold, prediction, seconds):
            return Verdict(0.0)
        return Verdict(0.0 if _states_a_false_equation(prediction, seconds) else 1.0)
    except TimeoutException:  # a BaseException, which math-verify raises from its alarm
        return Verdict(0.0, timed_out=True)
    except Exception:
        return Verdict(0.0)


def _parse(latex: str, seconds: int | None) -> list:
    """math-verify's parse of `latex` read whole (_LATEX_ONLY), [] where it fails, as math-verify's own default;
    but a parse its alarm ends raises TimeoutException, where math-verify would only log it and return []."""
    try:
        return parse(latex, extraction_config=_LATEX_ONLY, extraction_mode="first_match", parsing_timeout=seconds,
                     raise_on_error=True)
    except Exception:
        return []


def _equal(golds: Sequence, predictions: Sequence, seconds: int | None) -> bool:
    """math-verify's verify(golds, predictions): whether some pair of them is equal, compared pair by pair as it
    does, a pair that fails to compare counting as unequal; but when no pair is equal and its alarm ended a
    comparison, raises TimeoutException, where math-verify would only log it and return False."""
    timed_out = False
    for gold, prediction in product(golds, predictions):
        try:
            if verify(gold, prediction, timeout_seconds=seconds, raise_on_error=True):
                return True
        except TimeoutException:
            timed_out = True
        except Exception:
            pass
    if timed_out:
        raise TimeoutException("a comparison ran past reward.timeout_s")
    return False


def _braced_fractions(latex: str) -> str:
    """`\\frac\\pi4` -> `\\frac{\\pi}{4}`: each one-token argument of a fraction in braces (see _FRAC). The last
    fraction goes first, so that one inside another's braces is done before the outer one skips past it."""
    for frac in reversed(list(_FRAC.finditer(latex))):
        pos = frac.end()
        for _ in range(2):
            if re.match(r"\s*\{", latex[pos:]):
                pos = _group_end(latex, latex.index("{", pos))
                continue
            token = _TOKEN.match(latex, pos)
            if token is None or token.group(1).lstrip("\\") in _TAKES_ARGUMENTS:
                break
            latex = latex[:token.start(1)] + "{" + token.group(1) + "}" + latex[token.end():]
            pos = token.start(1) + len(token.group(1)) + 2
    return latex


def _group_end(latex: str, start: int) -> int:
    """Index after the brace group opening at `start` (the end of the text if it never closes)."""
    depth = 0
    for i in range(start, len(latex)):
        depth += {"{": 1, "}": -1}.get(latex[i], 0)
        if depth == 0:
            return i + 1
    return len(latex)


def _normalized(latex: str) -> str:
    """What math-verify is handed: thousands groups joined, line breaks read as spaces, fractions braced."""
    return _braced_fractions(_DIGIT_GROUP_SPACE.sub("", latex).replace("\n", " "))


def _states_a_false_equation(prediction: list, seconds: int | None) -> bool:
    """Whether the parsed answer equates numbers that differ: `41 = 42`, `x = 41 = 42`, `41 = x = 42`, `\\{41 = 42\\}`.

    Against a gold that is no equation, math-verify reads an equation (or a chain of them) by its last
    right-hand side, so each of those would score against 42. True ones (`\\frac{3}{6} = \\frac{1}{2}`,
    `n = 1024 = 2^{10}`) still score.
    """
    expr = prediction[0] if prediction else None
    if not isinstance(expr, Basic):
        return False
    chains = [[eq] for eq in expr.atoms(Eq)]
    chains += [chain for chain in (list(getattr(a, "_unsorted_args", a.args)) for a in expr.atoms(And))
               if all(isinstance(r, Eq) for r in chain)]
    for chain in chains:
        numbers = [side for r in chain for side in (r.lhs, r.rhs) if side.is_number]
        if any(not _equal([numbers[0]], [n], seconds) for n in numbers[1:]):
            return True
    return False


def check_label(label: str, max_answer_chars: int = MAX_ANSWER_CHARS) -> None:
    """Raise ValueError unless `label` is a usable gold answer (for validating dataset rows).

    Usable means: a non-empty string that is either marked as text (`\\text{...}`, see
    caspo.reward.labels) or math that math-verify parses (not only as a raw string) and that is
    not just a word, which math-verify would read as a product of letters; and a response boxing
    exactly that label scores 1.0 against it (otherwise no response could ever earn reward), under the
    run's answer length limit (`max_answer_chars`, reward.max_answer_chars). Runs math-verify with its
    SIGALRM timeouts, so call it from the main thread.
    """
    _require_main_thread()
    if not isinstance(label, str):
        raise ValueError(f"label must be a string, got {type(label).__name__}: {label!r}")
    gold = _strip_dollars(label)
    if not gold:
        raise ValueError(f"empty label: {label!r}")
    if blank_text_label(gold):  # with no letter in it, \text{\ } would otherwise be read as math
        raise ValueError(f"empty text label: {label!r}")
    if not text_label(gold):
        word = letter_word(gold)
        if word is not None:
            raise ValueError(f"label {label!r} is only letters, which math-verify reads as a product of symbols "
                             f"({'*'.join(word[:4])}...): mark a word as text (\\text{{{gold}}}) or write math as "
                             "LaTeX (\\pi, x \\cdot y)")
        try:
            parsed = _parse_gold(_normalized(gold), _alarm_seconds(5.0))
        except ValueError:
            raise ValueError(f"math-verify cannot parse label {label!r}") from None
        except TimeoutException:
            raise ValueError(f"math-verify did not parse label {label!r} within 5 s; simplify the label") from None
        if all(isinstance(p, str) for p in parsed):  # math-verify only echoed the text back
            raise ValueError(f"math-verify cannot parse label {label!r} as math (only as a string)")
    refused = too_costly(gold, max_answer_chars)
    if refused:
        raise ValueError(f"label {label!r} is refused by the verifier's pre-filter ({refused}), "
                         "so no answer could match it; simplify the label")
    sentence = _FORMULA_AND_PERIOD.fullmatch(label.strip())
    boxed = sentence.group(1) if sentence else gold  # a response boxes the formula, not the sentence's period
    if score("\\boxed{" + boxed + "}", label, max_answer_chars=max_answer_chars) != 1.0:
        raise ValueError(f"label {label!r} does not match itself: a response boxing it would score 0")


def _integer_verdict(answer: str, label: str) -> float | None:
    """Exact verdict when both sides are plain integers ("1,450,000", "\\$18", "-7"), else None.

    Agrees with math-verify, which compares integers exactly and reads thousands separators
    and dollar signs the same way; it only saves the parse for the common case. ASCII digits
    only: "４２" is not an integer here (math-verify scores it 0 too).
    """
    a, b = _as_integer(answer), _as_integer(label)
    if a is None or b is None:
        return None
    return 1.0 if a == b else 0.0


def _as_integer(text: str) -> int | None:
    text = text.replace("\\$", "").replace("$", "").strip()
    return int(text.replace(",", "")) if _INTEGER.fullmatch(text) else None


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, seconds: int | None) -> tuple:
    """Parsed gold, cached: each prompt's label is scored once per sampled response.

    Raises ValueError if nothing parses, TimeoutException if the parse ran past its alarm; a failure is not cached.
    """
    parsed = _parse("$" + gold + "$", seconds)
    if not parsed:
        raise ValueError(f"math-verify cannot parse {gold!r}")
    return tuple(parsed)


def _strip_dollars(label: str) -> str:
    """'$\\frac12$' -> '\\frac12'; an escaped trailing '\\$' is kept."""
    label = label.strip().lstrip("$")
    while label.endswith("$") and not label.endswith("\\$"):
        label = label[:-1]
    return label.strip()


def _require_main_thread() -> None:
    # Elsewhere math-verify's signal.alarm raises, and every answer would quietly score 0.
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math-verify's timeouts use SIGALRM: score in the main thread, or use RewardPool")


def _alarm_seconds(timeout_s: float | None) -> int | None:
    """SIGALRM counts whole seconds, and 0 would mean no alarm at all."""
    return None if timeout_s is None else max(1, math.ceil(timeout_s))
