"""Pull the final answer out of a model response: the last \\boxed{...}, else the last number."""

import re

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_BOX = re.compile(r"\s+([^\s$]+)")  # "\boxed 42": one token, up to a space or "$"

# A number: "1,450,000" (only well-formed thousands groups), "12", "3.5", ".5".
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+"
# A minus sign counts only where it cannot be subtraction: not right after a word, ")", "]" or "}".
_NUMBER = re.compile(rf"(?:(?<![\w)\]}}])[-\u2212])?(?:{_UNSIGNED})")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (or \\boxed 42), stripped.

    Only the last box counts, and it must close: a final box that is cut off or unbalanced
    gives None rather than an earlier box, so a response cannot be rewarded for an answer
    it went on to replace. Escaped braces (\\{, \\}) do not count towards the balance.
    An empty box gives None.
    """
    last = None
    for last in _BOX.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end():]
    body = rest.lstrip()
    if not body.startswith("{"):
        bare = _BARE_BOX.match(rest)
        token = bare.group(1).rstrip(".,;") if bare else ""
        return token or None
    start = last.end() + (len(rest) - len(body)) + 1
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":  # skip the escaped character: \{ \} \\
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, with thousands separators removed ("1,450,000" -> "1450000").

    Handles negatives ("-7", also the unicode minus), decimals ("3.5", ".5") and trailing
    sentence punctuation ("is 42." -> "42"). A hyphen right after a word or a closing
    bracket is read as subtraction, not a sign ("10-7" -> "7").
    """
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    return last.group(0).replace(",", "").replace("\u2212", "-")


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last box if there is one, else the last number."""
    boxed = last_boxed(text)
    return boxed if boxed is not None else last_number(text)
