"""LaTeX-aware and newline step splitters: one hand-derived case per rule, plus MATH-wide checks."""

import json
import random
import statistics
from pathlib import Path

import pytest

from caspo.segment import latex_step_starts, newline_step_starts

MATH_TEST = Path("/work/shared/data/math_test_full.jsonl")


def steps(text, split=latex_step_starts):
    starts = split(text)
    assert "".join(text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])) == text or not text
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def clause(n):
    """Plain words, exactly ``n`` characters, ending in a comma."""
    return ("word " * n)[: n - 1] + ","


# ---------------------------------------------------------------- failures upstream, fine here


def test_empty_text_has_no_steps():
    assert latex_step_starts("") == []


@pytest.mark.parametrize("text", ["x = 5", "The answer is 5.", "$\\boxed{5}$", "   ", "\n", "a"])
def test_too_short_text_is_one_step(text):
    assert latex_step_starts(text) == [0]


def test_math_nested_in_environment_is_absorbed():
    rows = [
        "We consider two cases:",
        "\n\\begin{align*}\nf(x) &= 1 \\text{ if $x>0$}\\\\",  # the opener glues to the first row
        "\nf(x) &= 0 \\text{ otherwise}",
        "\n\\end{align*}",
    ]
    assert steps("".join(rows)) == rows


def test_placeholder_lookalike_text():
    # the masking character must differ from every character of the text
    parts = ["The token \ue000\ue000 appears in $x$ here and there.", "\nNext line is long enough."]
    assert steps("".join(parts)) == parts


# ---------------------------------------------------------------- stage 2: sentences and lines


def test_sentence_boundary_after_period_then_uppercase():
    parts = ["We first compute the sum of all terms.", " Then we divide by the count."]
    assert steps("".join(parts)) == parts


@pytest.mark.parametrize(
    "text",
    [
        "Let the answer be called x. Then it equals four times y.",  # one-letter word
        "Pick any even number, e.g. Twelve works fine here.",  # one letter after a period
        "The letter was sent by Mr. Smith to the office today.",  # two letters after whitespace
        "We first compute the sum of all terms. then we divide by the count.",  # lowercase follows
    ],
)
def test_no_sentence_boundary(text):
    assert steps(text) == [text]


@pytest.mark.parametrize(
    "parts",
    [
        ["We tried apples, pears, etc.", " Bananas were not on the list at all."],
        ["The smallest value of the sum is 2.", " Larger values appear later."],
    ],
)
def test_digits_and_etc_do_split(parts):
    assert steps("".join(parts)) == parts


def test_newline_starts_the_next_step():
    parts = ["First line of the solution here", "\nSecond line of the solution here"]
    assert steps("".join(parts)) == parts


def test_newline_only_piece_glued_forward():
    parts = ["First line of the solution here", "\n\nSecond line of the solution here"]
    assert steps("".join(parts)) == parts


def test_short_piece_glued_forward():
    text = "So we get\nthe total number of apples is ten apples."  # "So we get": 9 chars, no period
    assert steps(text) == [text]


def test_masked_math_counts_as_sixty():
    # "So $x=1.$" is 9 real characters but 63 masked, so stage 2 keeps it;
    # stage 3 keeps it too because it ends in ".$"
    parts = ["So $x=1.$", "\nNext line is long enough."]
    assert steps("".join(parts)) == parts


# ---------------------------------------------------------------- stage 3: periods inside math


def test_split_after_period_closed_math():
    parts = ["We find that $x = 19.$", " Substituting gives the value $y = 7.$"]
    assert steps("".join(parts)) == parts
    parts = ["Hence \\[x = 4.\\]", " follows from the equation above"]  # 16 chars, protected
    assert steps("".join(parts)) == parts


def test_plain_period_does_not_protect_in_stage_3():
    text = "Short one.\nThe second line is long enough."  # "Short one." kept in stage 2, glued in 3
    assert steps(text) == [text]


def test_short_last_piece_glued_backward():
    text = "We find that $x = 19.$ Done"  # " Done" is last and short
    assert steps(text) == [text]


# ---------------------------------------------------------------- stage 4: newlines inside math


def test_align_rows_are_steps():
    rows = [
        "We expand the product as follows:",
        "\n\\begin{align*}\na &= b + c \\\\",
        "\n&= d",
        "\n\\end{align*}",  # closing delimiters stand alone, as upstream
    ]
    assert steps("".join(rows)) == rows


def test_tiny_row_glued_forward():
    # "\n3" is 2 characters; a closing "$$" reads as an opener, and being last it goes backward
    rows = ["The rows of the matrix are", "\n$$\n1 + 2 + 9", "\n3\n4 + 5\n$$"]
    assert steps("".join(rows)) == rows


def test_stacked_openers_glued_forward():
    rows = [
        "We expand the product as follows:",
        "\n\\[\\begin{aligned}\na &= b + c \\\\",
        "\n&= d + e",
        "\n\\end{aligned}\\]",
    ]
    assert steps("".join(rows)) == rows


def test_asy_rows_are_steps():
    rows = [
        "Here is the diagram of the triangle:",
        "\n[asy]\ndraw((0,0)--(1,1));",
        '\nlabel("$A$",(0,0),W);',
        "\n[/asy]",
    ]
    assert steps("".join(rows)) == rows


# ---------------------------------------------------------------- stage 5: long pieces


def test_language_cut_prefers_comma():
    parts = [
        "The first part of this sentence is long enough to stand alone,",
        " and the second part and the third part are also quite long here",
    ]
    assert len(parts[0]) >= 40 and len(parts[1]) >= 40 and len("".join(parts)) > 100
    assert steps("".join(parts)) == parts


def test_language_cut_after_and():
    parts = [
        "The first part of this sentence is long enough to stand alone and ",
        "the second part of this sentence is also long enough by itself",
    ]
    assert steps("".join(parts)) == parts


def test_language_cuts_halve_repeatedly_nearest_midpoint():
    # commas after 45, 95, 150, 200 of 260: first cut 150 (mid 130), then 95 (mid 75)
    # in [0, 150) and 200 (mid 205) in [150, 260)
    lengths = [45, 50, 55, 50]
    parts = [clause(n) for n in lengths] + ["word " * 11 + "words"]
    assert len(parts[-1]) == 60
    text = "".join(parts)
    assert steps(text) == [parts[0] + parts[1], parts[2], parts[3], parts[4]]


def test_raw_cut_after_equals_inside_math():
    parts = ["\\[" + "a" * 48 + "=", "b" * 48 + "\\]"]  # one math span: no language cut
    assert steps("".join(parts)) == parts


def test_raw_cut_after_comma_dollar():
    parts = ["$" + "a" * 50 + ",$", "b" * 50]
    assert steps("".join(parts)) == parts


def test_raw_cut_when_language_halves_too_short():
    # the comma leaves a 6-character half, so the cut falls after "="
    parts = ["Thus, \\[" + "a" * 45 + "=", "b" * 45 + "\\]"]
    assert steps("".join(parts)) == parts


def test_long_piece_without_cut_stays():
    assert steps("a" * 150) == ["a" * 150]


def test_math_solution_by_hand():
    # sentence cuts after "(x+3)$." and "-3$."; the 140-character middle sentence is cut
    # after "$0$," (the comma after "nonzero" leaves a 39-character half); its first
    # half is 102 characters but has no allowed cut
    parts = [
        "The denominator of the rational function factors into $x^2+x-6=(x-2)(x+3)$.",
        " Since the numerator is always nonzero, there is a vertical asymptote whenever the denominator is $0$,",
        " which occurs for $x = 2$ and $x = -3$.",
        "  Therefore, the graph has $\\boxed{2}$ vertical asymptotes.",
    ]
    assert steps("".join(parts)) == parts


# ---------------------------------------------------------------- newline splitter


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", []),
        ("a\nb", ["a", "\nb"]),
        ("a\n\nb", ["a", "\n\nb"]),
        ("a\n  \nb\n", ["a", "\n  \nb\n"]),  # blank lines forward, trailing blank backward
        ("\n\na", ["\n\na"]),
        ("\n\n", ["\n\n"]),
    ],
)
def test_newline_splitter(text, expected):
    assert steps(text, newline_step_starts) == expected


# ---------------------------------------------------------------- robustness

FRAGMENTS = [
    "$", "$$", "\\(", "\\)", "\\[", "\\]", "\\begin{align*}", "\\end{align*}", "\\begin{tabular}",
    "[asy]", "[/asy]", "\n", "\n\n", ". ", "The ", "x", " and ", ", ", ":", " to ", "=", "+",
    "\\equiv", ",$", ".$", ".\\]", "word ", "Mr. ", "e.g. ", "\\$", "\ue000", "é", "😀", "  ",
]  # fmt: skip


@pytest.mark.parametrize("split", [latex_step_starts, newline_step_starts])
def test_random_latex_soup_is_tiled(split):
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 60)))
        starts = split(text)
        assert starts[0] == 0 and starts[-1] < len(text)
        assert all(a < b for a, b in zip(starts, starts[1:]))


# ---------------------------------------------------------------- MATH-wide


@pytest.fixture(scope="module")
def math_solutions():
    if not MATH_TEST.exists():
        pytest.skip(f"{MATH_TEST} not found")
    return [json.loads(line)["solution"] for line in MATH_TEST.open()]


@pytest.mark.parametrize("split", [latex_step_starts, newline_step_starts])
def test_lossless_on_math(math_solutions, split):
    counts = []
    for text in math_solutions:
        starts = split(text)
        assert starts[0] == 0
        assert all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < len(text)
        assert "".join(text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])) == text
        counts.append(len(starts))
    mean, median = statistics.mean(counts), statistics.median(counts)
    print(f"{split.__name__}: {len(counts)} MATH test solutions, steps mean {mean:.2f}, median {median}")
    if split is latex_step_starts:
        assert 8 <= mean <= 12  # upstream: mean 9.8, median 7 on MATH train+test
