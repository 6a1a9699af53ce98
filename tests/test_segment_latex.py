"""LaTeX-aware and newline step splitters.

The LaTeX splitter is upstream VinePPO's in-place splitter: ``UPSTREAM_CASES`` are hand-derived cases, one or
more per rule, whose expected steps upstream's ``split_solution_inplace`` also gives (checked when they were
written; see tests/data/segment/README.md), and the fixture holds upstream's split of 64 more texts.
"""

import json
import random
import statistics
from pathlib import Path

import pytest

from caspo.data.registry import SHIPPED
from caspo.segment import latex_step_starts, newline_step_starts, segment_response

MATH_TEST = SHIPPED["math"].path  # the 5,000 MATH test problems, with their solutions
FIXTURE = Path(__file__).parent / "data" / "segment" / "upstream_splits.jsonl"


def steps(text, split=latex_step_starts):
    starts = split(text)
    assert "".join(text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])) == text or not text
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def clause(n):
    """Plain words, exactly ``n`` characters, ending in a comma."""
    return ("word " * n)[: n - 1] + ","


# ---------------------------------------------------------------- upstream's rules, by hand

UPSTREAM_CASES = [
    # stage 1: a masked span counts as 60 characters. "So $x=1.$" is 9 real characters but 63 masked, so
    # stage 2 keeps it; stage 3 keeps it too because it ends in ".$"
    pytest.param(["So $x=1.$", "\nNext line is long enough."], id="mask-counts-sixty"),
    # stage 2: a sentence ends at a period before whitespace and a capital; the whitespace opens the next step
    pytest.param(["We first compute the sum of all terms.", " Then we divide by the count."], id="sentence"),
    pytest.param(["We tried apples, pears, etc.", " Bananas were not on the list at all."], id="sentence-etc"),
    pytest.param(["The smallest value of the sum is 2.", " Larger values appear later."], id="sentence-digit"),
    # "3x." is one letter after a word character (no word boundary), so it ends a sentence
    pytest.param(["We find the product equals 3x.", " Then we divide both sides by three."], id="sentence-3x"),
    pytest.param(["Let the answer be called x. Then it equals four times y."], id="no-sentence-one-letter"),
    pytest.param(["Pick any even number, e.g. Twelve works fine here."], id="no-sentence-eg"),
    pytest.param(["The letter was sent by Mr. Smith to the office today."], id="no-sentence-two-letters"),
    pytest.param(["We first compute the sum of all terms. then we divide by the count."], id="no-sentence-lower"),
    # stage 2: a newline opens the next step; a short piece not ending in "." is glued forward
    pytest.param(["First line of the solution here", "\nSecond line of the solution here"], id="newline"),
    pytest.param(["First line of the solution here", "\n\nSecond line of the solution here"], id="blank-line"),
    pytest.param(["So we get\nthe total number of apples is ten apples."], id="short-glued-forward"),
    # a blank run of 20 or more characters is long enough to stay a step
    pytest.param(["First line of the solution here", "\n" + " " * 25, "\nSecond line of the solution here"],
                 id="long-blank-run"),
    # numbered lines: "\n1. $x=1$" is 64 masked characters (kept by stage 2) but 9 real ones, so stage 3 glues
    # it forward until the piece reaches 20
    pytest.param(["We list the cases in order.", "\n1. $x=1$\n2. $x=2$\n3. $x=3$, which is the largest.",
                  "\nSo there are three cases."], id="numbered-lines"),
    # stage 3: cut after math ending in ".$" / ".\]"; a plain "." does not protect a short piece here
    pytest.param(["We find that $x = 19.$", " Substituting gives the value $y = 7.$"], id="period-math"),
    pytest.param(["Hence \\[x = 4.\\]", " follows from the equation above"], id="period-display"),
    pytest.param(["Short one.\nThe second line is long enough."], id="plain-period-glued"),
    pytest.param(["We find that $x = 19.$ Done"], id="short-last-glued-back"),
    # stage 4: each newline inside math opens a step; a lone opener ("\n\[", "\n$$", "\n\begin{align*}") or a
    # piece under 3 characters is glued forward, backward when last
    pytest.param(["We expand the product as follows:", "\n\\begin{align*}\na &= b + c \\\\", "\n&= d",
                  "\n\\end{align*}"], id="align-rows"),
    pytest.param(["We expand the product as follows:", "\n\\[\\begin{aligned}", "\na &= b + c \\\\", "\n&= d + e",
                  "\n\\end{aligned}\\]"], id="stacked-openers-stay"),
    pytest.param(["Here is the diagram of the triangle:", "\n[asy]\ndraw((0,0)--(1,1));",
                  '\nlabel("$A$",(0,0),W);', "\n[/asy]"], id="asy-rows"),
    # "\n3" is 2 characters; the closing "$$" line reads as an opener, and being last it goes backward
    pytest.param(["The rows of the matrix are", "\n$$\n1 + 2 + 9", "\n3\n4 + 5\n$$"], id="tiny-row"),
    # display math, then text: the closing delimiter opens the next step ("\n$$" glued forward, "\]where")
    pytest.param(["The sum telescopes, so we get", "\n$$\nS = 1 - \\frac{1}{n+1}",
                  "\n$$\nwhich tends to one as n grows."], id="dollars-then-text"),
    pytest.param(["We solve the system and obtain", "\n\\[\nx = 2, \\quad y = 3",
                  "\n\\]where both values are positive integers."], id="bracket-then-where"),
    # equal math twice in one piece: only its first occurrence is cut at newlines
    pytest.param(["First we get $$", "\nx = 1", "\n$$ and then again $$\nx = 1\n$$ as before."], id="equal-math"),
    pytest.param(["First we get $$", "\nx = 1", "\n$$ and then again $$", "\nx = 2", "\n$$ as before."],
                 id="different-math"),
    # stage 5: a piece over 100 characters is halved at the cut nearest its middle; after "," the space opens
    # the next piece, after " and" / " to" too
    pytest.param(["The first part of this sentence is long enough to stand alone,",
                  " and the second part and the third part are also quite long here"], id="comma"),
    pytest.param(["The first part of this sentence is long enough to stand alone and",
                  " the second part of this sentence is also long enough by itself"], id="and"),
    pytest.param(["The first part of this sentence is long enough so that we want to",
                  " be cut right after a word and before the space that follows it"], id="to"),
    # commas at 45, 95, 150, 200 of 260: first cut 150 (middle 130), then 95 (middle 75) in [0, 150) and 200
    # (middle 205) in [150, 260)
    pytest.param([clause(45) + clause(50), clause(55), clause(50), "word " * 11 + "words"], id="halve-repeatedly"),
    # raw cuts on the real text: after "=" inside display math, after ",$"
    pytest.param(["\\[" + "a" * 48 + "=", "b" * 48 + "\\]"], id="raw-equals"),
    pytest.param(["$" + "a" * 50 + ",$", "b" * 50], id="raw-comma-dollar"),
    pytest.param(["\\[\\sum_{k=1}^{n} k^3 = \\left(\\frac{n(n+1)}{2}\\right)^2 =",
                  " \\frac{n^2(n+1)^2}{4} = \\frac{100^2 \\cdot 101^2}{4} = 25502500\\]"], id="raw-equals-space"),
    # the comma nearest the middle leaves a 6-character half, so the cut falls after "="
    pytest.param(["Thus, \\[" + "a" * 45 + "=", "b" * 45 + "\\]"], id="raw-when-language-short"),
    pytest.param(["a" * 150], id="no-cut-stays"),
    # 148 characters. The comma nearest the masked middle (129 of 295) leaves 32 real characters, the first
    # " and" 36, so no language cut; the "=" nearest the real middle (74) is at 43. The right half (105) starts
    # in the raw-cut range, so it skips language cuts (its " and" would leave 43 and 62) and has no raw cut.
    pytest.param(["Since $10^2 =100$, $17^2 = 289$, and $18^2=",
                  "324$, we know that the integers whose squares are between 100 and 300 are the integers "
                  "between 10 and 18."], id="no-language-after-raw"),
    # a MATH solution: sentence cuts after "(x+3)$." and "-3$.". The middle sentence (140 real, 302 masked
    # characters) stays whole: only the cut nearest the middle of each kind is tried, and the comma after "$0$"
    # (159 of 302) leaves 38 real characters, the " and" 9, the "=" nearest the middle 16.
    pytest.param(["The denominator of the rational function factors into $x^2+x-6=(x-2)(x+3)$.",
                  " Since the numerator is always nonzero, there is a vertical asymptote whenever the denominator "
                  "is $0$, which occurs for $x = 2$ and $x = -3$.",
                  "  Therefore, the graph has $\\boxed{2}$ vertical asymptotes."], id="math-solution"),
    # text resembling the mask: the masking character differs from every character of the text
    pytest.param(["The token \ue000\ue000 appears in $x$ here and there.", "\nNext line is long enough."],
                 id="mask-lookalike"),
]


@pytest.mark.parametrize("parts", UPSTREAM_CASES)
def test_upstream_rule(parts):
    assert steps("".join(parts)) == parts


def test_fixture_matches_upstream():
    rows = [json.loads(line) for line in FIXTURE.open()]
    assert len(rows) == 64
    differ = [r["id"] for r in rows if steps("".join(r["steps"])) != r["steps"]]
    assert not differ, f"{len(differ)} fixture texts split differently from upstream: {differ[:5]}"


# ---------------------------------------------------------------- texts upstream fails on


def test_empty_text_has_no_steps():
    assert latex_step_starts("") == []


@pytest.mark.parametrize("text", ["x = 5", "The answer is 5.", "$\\boxed{5}$", "   ", "\n", "a", "$$" + " " * 20])
def test_too_short_text_is_one_step(text):
    # the whole text glues into one weak piece (under 20 characters, or one opener): upstream fails
    assert latex_step_starts(text) == [0]


def test_math_nested_in_environment_is_absorbed():
    # upstream masks $x>0$ first and then cannot unmask the align* around it
    rows = [
        "We consider two cases:",
        "\n\\begin{align*}\nf(x) &= 1 \\text{ if $x>0$}\\\\",  # the opener glues to the first row
        "\nf(x) &= 0 \\text{ otherwise}",
        "\n\\end{align*}",
    ]
    assert steps("".join(rows)) == rows


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


def byte_decode(ids):
    """Tokens are single UTF-8 bytes, as a byte-level tokenizer's smallest tokens are."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("split", [latex_step_starts, newline_step_starts])
def test_math_solutions_round_trip_through_their_token_steps(math_solutions, split):
    """Each MATH solution, as byte tokens, segments into the splitter's steps: the tokens of step k decode to
    exactly the characters of step k, so no text is lost, doubled or moved to another step."""
    name = {latex_step_starts: "latex", newline_step_starts: "newline"}[split]
    counts = []
    for text in math_solutions:
        starts = split(text)
        assert starts[0] == 0
        assert all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < len(text)
        ids = list(text.encode())
        out = segment_response(byte_decode, ids, splitter=name)
        assert out.text == text and out.step_starts_chars == starts  # every step starts with a byte of its own
        rebuilt = [bytes(t for t, k in zip(ids, out.token_step_ids) if k == step).decode()
                   for step in range(out.num_steps)]
        assert rebuilt == [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
        counts.append(len(starts))
    mean, median = statistics.mean(counts), statistics.median(counts)
    print(f"{split.__name__}: {len(counts)} MATH test solutions, steps mean {mean:.2f}, median {median}")
    if split is latex_step_starts:
        assert 8 <= mean <= 12  # upstream: mean 9.8, median 7 on MATH train+test
