"""The verifier's verdicts on answer/label pairs, one row each: what `\\boxed{answer}` scores against
`label`. A change of verdict is a change of the reward: bump VERIFIER_VERSION with it."""

import pytest

from caspo.reward import score

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(120, method="thread")

PAIRS = [  # (kind, answer, label, expected)
    # fractions
    ("fraction", r"\frac{1}{2}", "0.5", 1.0),
    ("fraction", r"\dfrac12", r"\frac{1}{2}", 1.0),
    ("fraction", "1/2", r"\frac12", 1.0),
    ("fraction", r"\frac{2}{4}", r"\frac12", 1.0),
    ("fraction", r"-\frac{3}{4}", r"\frac{-3}{4}", 1.0),
    ("fraction", r"\frac{1}{3}", r"\frac12", 0.0),
    ("fraction", "0.333", r"\frac13", 0.0),  # a rounded decimal is not the fraction
    # decimals
    ("decimal", "3.0", "3", 1.0),
    ("decimal", "0.50", r"\frac{1}{2}", 1.0),
    ("decimal", ".5", "0.5", 1.0),
    ("decimal", "3.14", r"\pi", 0.0),
    ("decimal", "2.5", "2.6", 0.0),
    # percents
    ("percent", r"10\%", "10", 1.0),
    ("percent", "0.1", r"10\%", 1.0),
    ("percent", r"50\%", r"\frac12", 1.0),
    ("percent", r"25\%", "0.5", 0.0),
    # intervals
    ("interval", "[1,2]", "[1,2]", 1.0),
    ("interval", r"(0,\infty)", r"(0,\infty)", 1.0),
    ("interval", "(1,2)", "[1,2]", 0.0),
    ("interval", "(2,5)", "[2,5)", 0.0),
    ("interval", r"(-\infty, 3]", r"(-\infty,3]", 1.0),
    # tuples (ordered)
    ("tuple", "(1, 2, 3)", "(1,2,3)", 1.0),
    ("tuple", "(3,2,1)", "(1,2,3)", 0.0),
    ("tuple", r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", 1.0),
    # sets (unordered)
    ("set", r"\{1,2\}", r"\{2,1\}", 1.0),
    ("set", "3, 2, 1", r"\{1,2,3\}", 1.0),
    ("set", r"\{1,2\}", r"\{1,2,3\}", 0.0),
    ("set", "42, 43", "42", 0.0),  # a hedge of two answers is not the answer
    # units
    ("unit", r"10\text{ cm}", "10", 1.0),
    ("unit", "10", r"10\text{ cm}", 1.0),
    ("unit", r"18 \text{ dollars}", "18", 1.0),
    ("unit", r"\$18", "18", 1.0),
    ("unit", r"\$18.00", "18", 1.0),
    ("unit", r"20\text{ miles}", "21", 0.0),
    # thousands separators
    ("thousands", "1,450,000", "1450000", 1.0),
    ("thousands", "1450000", "1,450,000", 1.0),
    ("thousands", "1{,}000", "1000", 1.0),
    (r"thousands", r"1\,000", "1000", 1.0),
    ("thousands", "12,3456", "123456", 0.0),  # not a well-formed grouping
    # \text{} labels: words compared as words, never as products of letters
    ("text", r"\text{Evelyn}", r"\text{Evelyn}", 1.0),
    ("text", "Evelyn", r"\text{Evelyn}", 1.0),
    ("text", r"\textbf{ evelyn }", r"\text{Evelyn}", 1.0),
    ("text", "nevely", r"\text{Evelyn}", 0.0),  # an anagram (math-verify alone says equal)
    ("text", "silent", r"\text{listen}", 0.0),
    ("text", "nabana", r"\text{banana}", 0.0),
    ("text", r"\text{odd}", r"\text{even}", 0.0),
    ("text", "hello  world", r"\text{Hello World}", 1.0),
    # multiple choice
    ("choice", "A", "A", 1.0),
    ("choice", "(A)", "A", 1.0),
    ("choice", r"\text{(A)}", "A", 1.0),
    ("choice", "B", "A", 0.0),
    ("choice", "B", r"\text{(B)}", 1.0),
    ("choice", r"\textbf{(C)}", r"\text{(C)}", 1.0),
    ("choice", "D", r"\text{(C)}", 0.0),
    # equations, expressions, roots
    ("expression", "x = 5", "5", 1.0),
    ("expression", "y=3", "x=3", 0.0),
    ("expression", "(x+1)^2", "x^2+2x+1", 1.0),
    ("expression", r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", 1.0),
    ("expression", r"2\sqrt{2}", r"\sqrt{8}", 1.0),
    ("expression", r"\sqrt{2}", r"\sqrt{3}", 0.0),
    ("expression", r"42 \pm 1", "42", 0.0),
    # full-width digits are not digits
    ("digits", "\uff14\uff12", "42", 0.0),
]


@pytest.mark.parametrize("kind, answer, label, expected", PAIRS, ids=[f"{p[0]}:{p[1]}|{p[2]}" for p in PAIRS])
def test_equivalence(kind, answer, label, expected):
    assert score(f"The answer is $\\boxed{{{answer}}}$.", label) == expected


def test_the_table_is_big_and_balanced():
    assert len(PAIRS) >= 40
    assert {p[0] for p in PAIRS} >= {"fraction", "decimal", "percent", "interval", "tuple", "set", "unit",
                                    "thousands", "text", "choice"}
    assert 0.3 < sum(p[3] for p in PAIRS) / len(PAIRS) < 0.8
