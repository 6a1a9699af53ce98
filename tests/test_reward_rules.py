"""The verifier's rules, one table each: the pre-filter (cost), hedges, text labels (docs/reliability.md)."""

import pytest

from caspo.reward import check_label, normalize_text, score, text_label, too_costly
from caspo.reward.labels import letter_word, same_text
from caspo.reward.prefilter import MAX_ANSWER_CHARS, hedged

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(60, method="thread")

COSTLY = [  # (answer, why it is refused, or None)
    ("42", None),
    (r"\frac{\sqrt{3}}{2}", None),
    (r"2^{100000}", None),  # 30,103 digits
    (r"2^{2023}", None),
    (r"10^{18}", None),
    ("1000!", None),
    (r"\binom{100}{50}", None),
    (r"2^{2^{10}}", None),  # a tower of two
    (r"x^{y^{z}}", None),
    (r"e^{-x^2}", None),
    (r"2^{2^{n}}+1", None),
    (r"(x+1)^{100}", None),
    (r"x^{1000}", None),
    ("(" * 8 + "1" + ")" * 8, None),
    (r"(S_1,S_2)\in \{ (995^2,994^2), (45^2, 6^2)\}", None),  # 2^3,4: the exponent stops at the comma
    (r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}", None),
    ("3qr + 6q - 15r -30", None),
    ("x" * MAX_ANSWER_CHARS, None),
    ("x" * (MAX_ANSWER_CHARS + 1), "longer than"),
    ("(" * 9 + "1" + ")" * 9, "nested more than"),
    (r"\frac{1}{" * 9 + "2" + "}" * 9, "nested more than"),
    (r"2^{2^{2^{2}}}", "power tower"),
    (r"x^{y^{z^{w}}}", "power tower"),
    (r"\exp(\exp(\exp(9)))", "power tower"),
    (r"2^{1000000}", "digits"),
    (r"2^{300000007}", "digits"),
    ("2^300000007", "digits"),  # without braces math-verify takes every digit
    (r"2^{1{,}000{,}000}", "digits"),
    (r"2^{1\,000\,000}", "digits"),
    (r"10^{10^{10}}", "digits"),
    (r"9^{9^{9}}", "digits"),
    (r"(2^{100000})^{100000}", "digits"),
    (r"2^{10}^{10}", "digits"),  # a^b^c = a^(b^c)
    ("2**10**10", "digits"),
    ("100000!", "digits"),
    ("(10!)!", "digits"),
    (r"(10^{5})!", "digits"),
    (r"\binom{100000}{50000}", "digits"),
    (r"\Gamma(10^{8})", "digits"),
    (r"\sum_{k=1}^{10^6} k", "digits"),
    (r"(x+1)^{1000}", "raised to a power above"),
    (r"(2+\sqrt{3})^{1000}", "raised to a power above"),
]


@pytest.mark.parametrize("answer, why", COSTLY, ids=[c[0][:40] for c in COSTLY])
def test_too_costly(answer, why):
    refused = too_costly(answer)
    assert (refused is None) if why is None else (why in refused)


def test_refused_answers_score_zero_at_once():
    assert score(r"\boxed{2^{300000007}}", r"2^{300000007}") == 0.0
    assert score(r"\boxed{" + "1" * 400 + "}", "1" * 400) == 0.0
    assert score(r"\boxed{" + "1" * 400 + "}", "1" * 400, max_answer_chars=500) == 1.0


HEDGES = [  # (answer, refused as a hedge)
    (r"41 \lor 42", True), (r"41 \vee 42", True), (r"41 \land 42", True), (r"41 \to 42", True),
    (r"41 \Rightarrow 42", True), (r"41 \iff 42", True), (r"41 \mid 42", True), ("41 | 42", True),
    ("41 || 42", True), (r"41 \\ 42", True), (r"\begin{cases} 41 \\ 42 \end{cases}", True),
    (r"41 \circ 42", True), (r"41 \text{ (or } 42)", True), (r"41 \text{, } 42", True), (r"41 \sim 42", True),
    ("42", False), ("|-3|", False), ("|x|+|y|", False), ("5 | B", False), (r"30^\circ", False), (r"30^{\circ}", False),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", False), (r"\text{(A)}", False), (r"10\text{ cm}", False),
    (r"(0,1) \cup (2,3)", False), ("41, 42", False),  # a set: math-verify never equals it to a number
    # a unit in parentheses ending the answer, the only text group, words only: math-verify drops it
    (r"12 \text{ (cm)}", False), (r"60 \text{(minutes)}", False), (r"x = 42 \text{ (square units)}", False),
    # anything else in parentheses inside a text group still joins candidates
    (r"41 \text{ (or 42)}", True), (r"41 \text{ (not 42)}", True), (r"41 \text{ (or)}", True),
    (r"41 \text{ (and)}", True), (r"41 \text{ (cm, m)}", True), (r"41 \text{ (cm)} 42", True),
    (r"\text{(cm)} 42", True), (r"41 \text{ (cm)}^2", True), (r"41 \text{ then } 42 \text{ (cm)}", True),
    (r"41 \text{ (cm)} 42 \text{ (cm)}", True), (r"41 \text{ (41)}", True),
]


@pytest.mark.parametrize("answer, refused", HEDGES, ids=[h[0] for h in HEDGES])
def test_hedged(answer, refused):
    assert (hedged(answer) is not None) == refused
    if refused:
        assert score(f"\\boxed{{{answer}}}", "42") == 0.0


# Boxes that do not parse whole, which math-verify's defaults read by their last plain expression (42), and
# equations between two numbers that differ, which it reads by their right-hand side: each scored 1 against 42
# before the box was read whole and false equations refused.
FRAGMENTS = [r"41 ? 42", r"41 @ 42", r"1, 2, \dots, 42", r"41 \dots 42", r"41 \star 42", r"41 \cup 42",
             r"\{41\}\cup 42", r"41 ~ 42", r"41 \operatorname{or} 42", r"41 --> 42", r"41 ==> 42", r"41 <=> 42",
             r"41 \vert 42", r"41 \| 42", r"41 \# 42", r"41 \& 42", r"41 & 42", r"41 \subset 42", r"41 \Leftarrow 42",
             r"41 \forall 42", r"41 = 42", r"41 \equiv 42", r"x = 41 = 42", r"41 = x = 42", r"\{41 = 42\}",
             r"41 \approx 42 = 42"]


@pytest.mark.parametrize("answer", FRAGMENTS)
def test_an_answer_is_read_whole_and_a_false_equation_scores_zero(answer):
    assert score(f"\\boxed{{{answer}}}", "42") == 0.0


@pytest.mark.parametrize("answer, label", [
    ("x = 42", "42"), (r"\frac{3}{6} = \frac{1}{2}", r"\frac12"), ("2+2=4", "4"), ("n = 1024 = 2^{10}", "1024"),
    ("f(2) = 42", "42"), (r"\sqrt{2} = 1.41421356", r"\sqrt2"), (r"\frac13 \approx 0.333", r"\frac13"),
    (r"(0,1)\cup(2,3)", r"(0,1)\cup(2,3)"), (r"\{41\}\cup\{42\}", r"\{41,42\}"), ("a=41, b=42", "41,42"),
])
def test_true_equations_and_whole_unions_still_score(answer, label):
    assert score(f"\\boxed{{{answer}}}", label) == 1.0


@pytest.mark.parametrize("answer, label, expected", [
    (r"\frac\pi4", r"\frac{\pi}{4}", 1.0), (r"\dfrac \pi 4", r"\frac{\pi}{4}", 1.0),
    (r"\frac3\pi", r"\frac{3}{\pi}", 1.0),
    (r"\frac{1}{\frac\pi2}", r"\frac{2}{\pi}", 1.0), (r"\frac{\pi}{4} + 2 - \sqrt2", r"\frac \pi4 + 2 - \sqrt2", 1.0),
    ("2", r"\frac \pi4 + 2 - \sqrt2", 0.0),  # math-verify read this gold as 2: it misreads `\frac \pi4`
    ("90", "90\\text{ square\nunits}", 1.0),  # a line break inside the gold's text
    ("4", "4:40 a.m.", 0.0), ("4:40 a.m.", "4:40 a.m.", 1.0),  # a gold that parses only as text: its text alone
])
def test_fractions_without_braces_and_golds_read_whole(answer, label, expected):
    assert score(f"\\boxed{{{answer}}}", label) == expected


@pytest.mark.parametrize("response", [r"\boxed{42.}", r"\boxed{42,}", r"\boxed 42.", r"\boxed{42}."])
def test_a_period_ending_the_sentence_inside_the_box_does_not_matter(response):
    assert score(response, "42") == 1.0 and score(response, "41") == 0.0


@pytest.mark.parametrize("answer, label", [(r"12 \text{ (cm)}", "12"), (r"60 \text{ (minutes)}", "60"),
                                           (r"60\text{(minutes)}", "60")])
def test_a_unit_in_parentheses_scores_as_upstream_math_verify_does(answer, label):
    assert score(f"\\boxed{{{answer}}}", label) == 1.0
    assert score(f"\\boxed{{{answer}}}", "13") == 0.0


def test_the_configured_answer_length_limit_holds_for_labels():
    label = r"\frac{1}{2} + \frac{1}{3} + \frac{1}{4} + \frac{1}{5} + \frac{1}{6} + \frac{1}{7} + \frac{1}{8}"
    assert 60 < len(label) < MAX_ANSWER_CHARS
    check_label(label)  # the default limit lets a box of it through
    assert score(f"\\boxed{{{label}}}", label, max_answer_chars=60) == 0.0  # no answer could match it
    with pytest.raises(ValueError, match="longer than 60 characters"):
        check_label(label, max_answer_chars=60)


def test_a_gold_read_only_as_text_is_rejected_at_load():
    with pytest.raises(ValueError, match="only as a string"):
        check_label("4:40 a.m.")


@pytest.mark.parametrize("label, expected", [
    (r"\text{Evelyn}", True), (r"\textbf{odd}", True), (r"\mbox{June 20}", True), (r"\text{(C)}", True),
    (r"\text{}", False), (r"\text{5}", False), (r"10\text{ cm}", False), ("Evelyn", False), (r"\text{a}+1", False),
])
def test_text_label(label, expected):
    assert text_label(label) == expected


@pytest.mark.parametrize("label, word", [
    ("banana", "banana"), ("hello world", "hello"), ("None", "None"), ("nan", "nan"), ("xy", "xy"), ("pi", "pi"),
    ("A", None), ("(B)", None), ("x", None), ("3qr + 6q - 15r -30", None), ("2RC+R+C", None), (r"\pi", None),
    (r"\text{banana}", None), (r"\overline{CD}", None), (r"\frac{\sqrt{3}}{2}", None), (r"10\text{ cm}", None),
])
def test_letter_word(label, word):
    assert letter_word(label) == word


@pytest.mark.parametrize("text, normal", [
    (r"\text{Evelyn}", "evelyn"), (r"  The  Answer. ", "the answer"), (r"\text{(B)}", "b"), ("[C]", "c"),
    (r"\textbf{\text{ Odd }}", "odd"), (r"$\text{June}\ 20$", "june 20"), ("(a),(d)", "(a),(d)"), ("A, D", "a,d"),
])
def test_normalize_text(text, normal):
    assert normalize_text(text) == normal


def test_same_text_compares_lists_in_any_order():
    assert same_text("D, A", r"\text{A,D}") and same_text(r"\text{(A), (D)}", r"\text{A,D}")
    assert not same_text("A", r"\text{A,D}") and not same_text("A, D, E", r"\text{A,D}")


@pytest.mark.parametrize("answer, label", [("nabana", "banana"), ("silent", "listen"), ("enon", "None")])
def test_anagrams_of_an_unmarked_word_label_score_zero(answer, label):
    """A word label that reaches score unchecked is compared as text, never as a product of letters."""
    assert score(f"\\boxed{{{answer}}}", label) == 0.0
    assert score(f"\\boxed{{{label}}}", label) == 1.0
