"""Text labels: words are compared as words, never as math.

math-verify reads letters as a product of symbols, so against the label `banana` the answer
`nabana` is "equal" (both are a^3 b n^2), and `silent` equals `listen`. caspo therefore:

- compares a label marked as text as a normalized string (`same_text`, `normalize_text`). The
  marking: the whole label is one `\\text{...}` group (or \\textbf, \\textit, \\textrm, \\textsf,
  \\texttt, \\mbox): `\\text{Evelyn}`, `\\text{(C)}`, `\\text{odd}`;
- rejects, in `check_label`, an unmarked label that is only a word or words (`banana`,
  `hello world`, `None`, `nan`): outside LaTeX commands and text groups it has nothing but letters,
  spaces and punctuation, and two or more letters in a row (`letter_word`). The fix is to mark it
  as text. Math with letters (`3qr + 6q - 15r`, `2RC+R+C`, `x^2y`, a choice `A` or `(B)`) is math.
  `score` compares such an unmarked word label as text too, should one reach it unchecked.
"""

import re

_TEXT_COMMANDS = r"text|textbf|textit|textrm|textsf|texttt|mbox"
_WHOLE_TEXT = re.compile(rf"\\(?:{_TEXT_COMMANDS})\s*\{{([^{{}}]*)\}}")
# Groups whose content is not math: text, fonts, environment names, operator names.
_NON_MATH_GROUP = re.compile(
    rf"\\(?:{_TEXT_COMMANDS}|mathrm|mathbf|mathit|mathsf|mathtt|mathbb|mathcal|operatorname|begin|end)"
    r"\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+|\\.")
_WORDS_ONLY = re.compile(r"[A-Za-z\s.,;:'!?()\-]*")
_LETTER_RUN = re.compile(r"[A-Za-z]{2,}")
_LATEX_SPACE = re.compile(r"\\[ ,;:!]|~|\\quad|\\qquad")
_WRAPPERS = re.compile(rf"\\(?:{_TEXT_COMMANDS}|mathrm|mathbf|mathit)\s*\{{([^{{}}]*)\}}")


def text_label(label: str) -> bool:
    """Whether `label` (dollar signs stripped) is marked as text: one whole \\text{...} group with a letter."""
    whole = _WHOLE_TEXT.fullmatch(label.strip())
    return whole is not None and re.search(r"[A-Za-z]", whole.group(1)) is not None


def blank_text_label(label: str) -> bool:
    """Whether `label` is one whole \\text{...} group with nothing comparable in it (spaces, spacing commands)."""
    return _WHOLE_TEXT.fullmatch(label.strip()) is not None and not normalize_text(label)


def letter_word(label: str) -> str | None:
    """The word an unmarked label consists of, if it is only words ("banana", "None"), else None."""
    bare = label
    for _ in range(4):  # nested groups, innermost first
        bare = _NON_MATH_GROUP.sub(" ", bare)
    bare = _COMMAND.sub(" ", bare)
    if _WORDS_ONLY.fullmatch(bare):
        run = _LETTER_RUN.search(bare)
        if run:
            return run.group(0)
    return None


def normalize_text(text: str) -> str:
    """The comparable form of a text answer or label.

    Removes `$`, unwraps \\text{}, \\textbf{}, \\textit{}, \\textrm{}, \\textsf{}, \\texttt{}, \\mbox{},
    \\mathrm{}, \\mathbf{}, \\mathit{} (nested too), reads LaTeX spaces (`\\ `, `\\,`, `~`, \\quad, ...) as
    spaces, casefolds, collapses whitespace (none around commas), drops a final period and one pair
    of parentheses or brackets around the whole: "\\text{(B)}" -> "b", "  The  Answer. " -> "the answer".
    """
    text = text.replace("$", "")
    for _ in range(4):
        unwrapped = _WRAPPERS.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = _LATEX_SPACE.sub(" ", text)
    text = " ".join(text.casefold().split()).replace(" ,", ",").replace(", ", ",")
    return _unwrap(text.removesuffix(".").strip())


def same_text(answer: str, label: str) -> bool:
    """Whether a text answer says the label: equal normalized strings, and a comma-separated list
    (multiple-select choices, `\\text{A,D}`) equal to the label's items in any order."""
    a, b = normalize_text(answer), normalize_text(label)
    if a == b:
        return True
    return "," in b and sorted(map(_unwrap, a.split(","))) == sorted(map(_unwrap, b.split(",")))


def _unwrap(text: str) -> str:
    """Without one pair of brackets around the whole: "(b)" -> "b", but "(a),(d)" stays."""
    text = text.strip()
    if len(text) < 2 or (text[0], text[-1]) not in {("(", ")"), ("[", "]")}:
        return text
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if depth == 0 and i < len(text) - 1:
            return text  # the first bracket closes before the end
    return text[1:-1].strip()
