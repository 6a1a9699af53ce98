"""Pull the final answer out of a model response (docs/reliability.md, "Verifier").

Two extractors, chosen by `reward.extractor`:

- "boxed": the content of the LAST \\boxed{...} (or \\fbox{...}, or \\boxed 42).
- "minerva": what follows the LAST "final answer is" (Minerva's "Final Answer: The final answer
  is $X$. I hope it is correct.").

Only the last candidate counts: if it is cut off, unbalanced or empty the response has no answer,
never an earlier one, so a response is not rewarded for an answer it went on to replace.

A response in which the extractor finds no candidate at all may fall back on its last number
(`reward.fallback: last_number`), for tasks that ask for it; the default is no fallback.

Digits are ASCII only: "４２" (full-width) is not a number here.
"""

import re

EXTRACTORS = ("boxed", "minerva")
FALLBACKS = ("none", "last_number")

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_BOX = re.compile(r"\s+([^\s$]+)")  # "\boxed 42": one token, up to a space or "$"
_BRACE_OR_ESCAPE = re.compile(r"[{}\\]")
_FINAL_PUNCTUATION = re.compile(r"(?<=[0-9)\]}])[.,]$")

# A number: "1,450,000" (only well-formed thousands groups), "12", "3.5", ".5"; ASCII digits only.
_UNSIGNED = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|(?<![0-9])\.[0-9]+"
# A minus sign counts only where it cannot be subtraction: not right after a word, ")", "]" or "}".
_NUMBER = re.compile(rf"(?:(?<![\w)\]}}])[-\u2212])?(?:{_UNSIGNED})")

# Minerva's closing formula, and the phrase itself (a colon after "is" is allowed). The period and spaces before
# "I hope" are stripped off the text before it: a leading `\.?\s*` here would rescan every run of spaces from
# each of its characters, quadratic in its length.
_FINAL = re.compile(r"final\s+answer\s+is\s*:?", re.IGNORECASE)
_HOPE = re.compile(r"I\s+hope\s+it\s+is\s+correct", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (or \\boxed 42), stripped, without a period or comma
    ending it after a number or a bracket (`\\boxed{42.}` is 42, as `\\boxed 42.` is).

    Only the last box counts, and it must close: a final box that is cut off or unbalanced
    gives None rather than an earlier box. Escaped braces (\\{, \\}) do not count towards the
    balance. An empty box gives None.
    """
    last = None
    for last in _BOX.finditer(text):
        pass
    if last is None:
        return None
    return _box_body(text, last.end())


def has_box(text: str) -> bool:
    return _BOX.search(text) is not None


def minerva_answer(text: str) -> str | None:
    """The answer after the last "final answer is", as Minerva's prompt format writes it.

    "The final answer is $X$. I hope it is correct." gives X: a `$...$` (or `$$...$$`) right after
    the phrase is taken whole and must close; otherwise the rest of the line, up to "I hope it is
    correct" or a sentence-ending period. A box inside the answer is unwrapped ("$\\boxed{X}$" -> X).
    Empty, or an unclosed "$", gives None.
    """
    last = None
    for last in _FINAL.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end():].lstrip()
    if rest.startswith("$"):
        fence = "$$" if rest.startswith("$$") else "$"
        end = _closing_dollar(rest, len(fence), fence)
        if end is None:
            return None
        answer = rest[len(fence):end]
    else:
        answer = rest.split("\n", 1)[0]
        hope = _HOPE.search(answer)
        if hope:
            answer = _without_final_period(answer[:hope.start()].rstrip())
        answer = _without_final_period(answer.strip())
    answer = answer.strip()
    if has_box(answer):
        return last_boxed(answer)
    return answer or None


def last_number(text: str) -> str | None:
    """The last number in the text, with thousands separators removed ("1,450,000" -> "1450000").

    Handles negatives ("-7", also the unicode minus), decimals ("3.5", ".5") and trailing
    sentence punctuation ("is 42." -> "42"). A hyphen right after a word or a closing
    bracket is read as subtraction, not a sign ("10-7" -> "7"). ASCII digits only.
    """
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    return last.group(0).replace(",", "").replace("\u2212", "-")


def extract_answer(text: str, extractor: str = "boxed", fallback: str = "none") -> str | None:
    """The final answer of a response, or None.

    extractor "boxed": the last box (None if it is cut off or empty). "minerva": the answer after
    the last "final answer is" (None if it is cut off or empty).
    fallback "last_number": when the extractor finds no candidate at all (no box; no "final answer
    is"), the last number of the text. A candidate that is broken never falls back.
    """
    if extractor == "boxed":
        found = has_box(text)
        answer = last_boxed(text) if found else None
    elif extractor == "minerva":
        found = _FINAL.search(text) is not None
        answer = minerva_answer(text) if found else None
    else:
        raise ValueError(f"unknown reward.extractor {extractor!r}: use one of {', '.join(EXTRACTORS)}")
    if found:
        return answer
    if fallback == "last_number":
        return last_number(text)
    if fallback != "none":
        raise ValueError(f"unknown reward.fallback {fallback!r}: use one of {', '.join(FALLBACKS)}")
    return None


def _box_body(text: str, after: int) -> str | None:
    rest = text[after:]
    body = rest.lstrip()
    if not body.startswith("{"):
        bare = _BARE_BOX.match(rest)
        token = bare.group(1).rstrip(".,;") if bare else ""
        return token or None
    start = after + (len(rest) - len(body)) + 1
    depth, pos = 1, start
    while True:  # jump from brace to brace: a megabyte of plain text costs one regex scan
        hit = _BRACE_OR_ESCAPE.search(text, pos)
        if hit is None:
            return None
        char, pos = hit.group(0), hit.end()
        if char == "\\":  # skip the escaped character: \{ \} \\
            pos += 1
        elif char == "{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return _without_final_punctuation(text[start:pos - 1].strip()) or None


def _without_final_period(text: str) -> str:
    return text[:-1] if text.endswith(".") else text


def _without_final_punctuation(box: str) -> str:
    """A box's content without one period or comma ending a sentence inside it after a number or a bracket
    (`\\boxed{42.}`, `\\boxed{\\frac{1}{2},}`), as the unbraced box loses it (`\\boxed 42.`). One after a letter
    stays: it may be part of a text answer (`4:40 a.m.`)."""
    return _FINAL_PUNCTUATION.sub("", box)


def _closing_dollar(text: str, start: int, fence: str) -> int | None:
    """Index of the first unescaped `fence` at or after start, or None."""
    pos = start
    while True:
        pos = text.find(fence, pos)
        if pos < 0:
            return None
        if pos == 0 or text[pos - 1] != "\\":
            return pos
        pos += 1
