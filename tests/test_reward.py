"""Final-answer extraction and scoring, run inline (math-verify's SIGALRM needs the main thread)."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from math_verify import parse, verify

from caspo.reward import (
    VERIFIER_VERSION,
    check_label,
    extract_answer,
    last_boxed,
    last_number,
    minerva_answer,
    score,
)

# pytest-timeout's default "signal" method shares SIGALRM with math-verify, which would
# cancel it; the thread method does not interfere.
pytestmark = pytest.mark.timeout(60, method="thread")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{3}.", "3"),
        (r"\boxed{3} no wait \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
        (r"\boxed{\left\{ x \right\}}", r"\left\{ x \right\}"),
        (r"\boxed { 7 }", "7"),
        (r"\fbox{5}", "5"),
        (r"$\boxed 42$.", "42"),
        (r"answer: \boxed 42.", "42"),
        (r"\boxed{\boxed{9}}", "9"),
        (r"\boxed{\$18}", r"\$18"),
        (r"\boxed{42.}", "42"),  # the period ending a sentence, as \boxed 42. loses it
        (r"\boxed{\frac{1}{2},}", r"\frac{1}{2}"),
        (r"\boxed{(1, 2).}", "(1, 2)"),
        (r"\boxed{4:40 a.m.}", "4:40 a.m."),  # after a letter it may be the answer's own
        (r"\boxed{5\,}", r"5\,"),  # a LaTeX space
        (r"\boxed{3} then \boxed{\frac{1}{2}", None),  # last box cut off: no earlier box instead
        (r"\boxed{}", None),
        (r"ends with \boxed", None),
        (r"\boxedfoo{3}", None),
        ("no box, 42", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The total is 1,450,000 dollars.", "1450000"),
        ("1,234.5 kg", "1234.5"),
        ("x = -7.", "-7"),
        ("so (-3) works", "-3"),
        ("10-7", "7"),  # subtraction, not a sign
        ("f(2)-3", "3"),
        ("it costs $3.50", "3.50"),
        ("about .5 of it", ".5"),
        ("\u22124", "-4"),  # unicode minus
        ("12,3456", "3456"),  # not a thousands-grouped number
        ("it is \uff14\uff12", None),  # full-width digits are not digits here
        ("7 or \u0664\u0662", "7"),  # nor are Arabic-Indic ones
        ("1, 2, 3", "3"),
        ("step 2: 40 + 2 = 42. Done", "42"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_extract_answer_takes_the_last_box_and_falls_back_only_when_asked():
    assert extract_answer(r"try 5, so \boxed{6} and 7 steps") == "6"
    assert extract_answer("we get 1,450,000 in total") is None  # no box, no fallback: no answer
    assert extract_answer("we get 1,450,000 in total", fallback="last_number") == "1450000"
    assert extract_answer("I have no idea", fallback="last_number") is None
    # a broken last box never falls back, neither to an earlier box nor to a number
    assert extract_answer(r"So \boxed{42}. Wait, no: \boxed{x=", fallback="last_number") is None
    assert extract_answer(r"I think it is 42. \boxed{}", fallback="last_number") is None


def test_unknown_extractor_or_fallback_is_a_clear_error():
    with pytest.raises(ValueError, match="reward.extractor"):
        extract_answer("x", extractor="last")
    with pytest.raises(ValueError, match="reward.fallback"):
        extract_answer("x", fallback="first_number")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Final Answer: The final answer is $42$. I hope it is correct.", "42"),
        (r"Final Answer: The final answer is $\frac{1}{2}$. I hope it is correct.", r"\frac{1}{2}"),
        ("The final answer is 42. I hope it is correct.", "42"),
        ("the final answer is: $x = 3$", "x = 3"),
        (r"The final answer is $\boxed{7}$.", "7"),
        ("Final answer is 3.5.\nMore text", "3.5"),
        ("The final answer is $$12$$", "12"),
        (r"The final answer is $\$18$.", r"\$18"),
        ("The final answer is $5$. Wait, the final answer is $6$. I hope it is correct.", "6"),  # the last one
        ("The final answer is $5$. Hmm, the final answer is $6", None),  # last one cut off: no answer
        ("The final answer is $$. I hope it is correct.", None),
        ("The final answer is . I hope it is correct.", None),
        (r"So \boxed{42}.", None),  # no Minerva phrase
        ("", None),
    ],
)
def test_minerva_answer(text, expected):
    assert minerva_answer(text) == expected


def test_minerva_extractor_in_score():
    text = "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct."
    assert score(text, "0.5", extractor="minerva") == 1.0
    assert score(text, "0.5") == 0.0  # the boxed extractor finds no box
    assert score("The answer is 0.5", "0.5", extractor="minerva") == 0.0
    assert score("The answer is 0.5", "0.5", extractor="minerva", fallback="last_number") == 1.0


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # fractions
        (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"So the answer is \boxed{\frac{1}{2}}.", r"\frac12", 1.0),
        (r"So the answer is \boxed{\frac{1}{2}}.", r"$\frac12$", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{3}}", r"\frac12", 0.0),
        (r"\boxed{$\frac12$}", "0.5", 1.0),  # stray $ inside the box
        # negatives
        (r"\boxed{-7}", "-7", 1.0),
        (r"\boxed{7}", "-7", 0.0),
        # thousands separators and currency
        (r"\boxed{1,450,000}", "1450000", 1.0),
        (r"\boxed{1450000}", "1,450,000", 1.0),
        (r"\boxed{1\;450\:000}", "1450000", 1.0),  # medium and thick spaces as thousands separators
        (r"\boxed{12\;3}", "123", 0.0),  # not a group of three
        (r"\boxed{\$18}", "18", 1.0),
        (r"\boxed{\$18.00}", "18", 1.0),
        # no box: no answer (the last-number fallback is off by default)
        ("He pays 3 * 6 = 18 dollars.", "18", 0.0),
        ("The answer is 41. Not 42.", "42", 0.0),
        # replaced or disowned: the last box is broken or empty, so no earlier answer counts
        (r"So \boxed{42}. Wait, no: \boxed{x=", "42", 0.0),
        (r"I think it is 42. \boxed{}", "42", 0.0),
        # Unicode digits are not digits (the integer shortcut is ASCII; math-verify agrees)
        ("\\boxed{\uff14\uff12}", "42", 0.0),
        # nothing to extract
        ("I don't know.", "18", 0.0),
        ("", "18", 0.0),
        (r"\boxed{}", "18", 0.0),
        # two boxes: only the last counts (math-verify alone would merge them into {2, 3})
        (r"First \boxed{3}, no wait: \boxed{2}", "2", 1.0),
        (r"First \boxed{3}, no wait: \boxed{2}", "3", 0.0),
        (r"\boxed{2}\boxed{3}", "2", 0.0),
        # nested braces and other math
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
        (r"\boxed{3, 2, 1}", r"\{1,2,3\}", 1.0),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", 1.0),
        (r"\boxed{(2,5)}", "[2,5)", 0.0),
        # plain wrong answers
        (r"\boxed{6}", "5", 0.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt{3}", 0.0),
    ],
)
def test_score(response, label, expected):
    assert score(response, label) == expected


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("He pays 3 * 6 = 18 dollars.", "18", 1.0),
        ("He pays 3 * 6 = 19 dollars.", "18", 0.0),
        ("18 is wrong, it is 17", "18", 0.0),
        ("so x = -7.", "-7", 1.0),
        ("The total is 1,450,000.", "1450000", 1.0),
        (r"\boxed{17} though 18 is close", "18", 0.0),  # a box is an answer: no fallback
        (r"I think it is 18. \boxed{}", "18", 0.0),
    ],
)
def test_score_with_the_last_number_fallback(response, label, expected):
    assert score(response, label, fallback="last_number") == expected


def test_truncated_response_scores_zero_even_if_correct():
    assert score(r"\boxed{42}", "42", finished=True) == 1.0
    assert score(r"\boxed{42}", "42", finished=False) == 0.0
    assert score(r"\boxed{\frac{1}{2}}", "0.5", finished=False) == 0.0


def test_garbage_responses_score_zero_without_raising():
    garbage = [r"\boxed{\frac{", r"\boxed{}}}}{{", "\\" * 1000, r"\boxed{\begin{pmatrix}}", "\x00\uffff", "9" * 5000]
    for response in garbage:
        assert score(response, r"\frac12") == 0.0


@pytest.mark.parametrize(
    "answer, label",
    [("7", "7"), ("7", "8"), ("-7", "7"), ("-0", "0"), ("007", "7"), ("1,450,000", "1450000"), ("1,000", "1,000"),
     (r"\$18", "18"), ("123456789012345678", "123456789012345679"), ("10", "1,0")],
)
def test_integer_shortcut_agrees_with_math_verify(answer, label):
    expected = float(verify(parse(f"${label}$"), parse(f"$\\boxed{{{answer}}}$")))
    assert score(f"\\boxed{{{answer}}}", label) == expected


def test_timeouts_need_the_main_thread():
    errors, results = [], []

    def run():
        try:
            score(r"\boxed{1}", "1")
        except RuntimeError as error:
            errors.append(str(error))
        results.append(score(r"\boxed{\frac{1}{2}}", "0.5", timeout_s=None))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == ["math-verify's timeouts use SIGALRM: score in the main thread, or use RewardPool"]
    assert results == [1.0]


def test_non_string_label_is_a_programming_error():
    with pytest.raises(TypeError, match="label must be a str, got int: 18"):
        score(r"\boxed{18}", 18)


@pytest.mark.parametrize("label", ["18", "-7", r"\frac12", "$0.5$", r"\text{Evelyn}", r"\{1,2,3\}", r"\$18",
                                   "3qr + 6q - 15r -30", "2RC+R+C", "A", "(B)", r"\text{(C)}", r"\text{hello world}",
                                   r"20\text{ miles}", r"\overline{CD}", r"\pi"])
def test_check_label_accepts(label):
    check_label(label)


NOT_A_STRING = "label must be a string"
EMPTY = "empty label"
UNPARSED = r"math-verify cannot parse label '.*'$"  # the parse failed
ONLY_A_STRING = r"math-verify cannot parse label .* as math \(only as a string\)"  # parsed only as text
A_WORD = "is only letters, which math-verify reads as a product of symbols"


@pytest.mark.parametrize("label, message", [
    ("", EMPTY), ("   ", EMPTY), ("$$", EMPTY), (r"\text{\quad}", "empty text label"),
    (r"\text{}", "empty text label"), (r"\text{ }", "empty text label"), (r"\text{\ }", "empty text label"),
    ("\\", UNPARSED),
    ("}{", ONLY_A_STRING), ("???", ONLY_A_STRING),
    (None, NOT_A_STRING), (18, NOT_A_STRING),
    ("banana", A_WORD), ("hello world", A_WORD), ("None", A_WORD), ("nan", A_WORD), ("listen", A_WORD), ("xy", A_WORD),
    (r"2^{10^{10}}", r"refused by the verifier's pre-filter \(a number of more than \d+ digits\)"),
])
def test_check_label_rejects(label, message):
    """Each refused label is refused by its own rule, which the message names."""
    with pytest.raises(ValueError, match=message):
        check_label(label)


def test_check_label_names_the_fix_for_a_word():
    with pytest.raises(ValueError, match=r"mark a word as text \(\\text\{banana\}\)"):
        check_label("banana")


def test_a_gold_that_is_a_formula_ending_a_sentence_is_judged_by_the_formula():
    """College Math writes some golds as `$h=4$.`: the check boxes the formula (a box of the whole label,
    period and dollars included, does not parse), and the verdicts are the formula's."""
    check_label("$h=4$.")
    check_label("$(x, y)=(1,0)$.")
    assert score(r"\boxed{4}", "$h=4$.") == score(r"\boxed{h=4}", "$h=4$.") == 1.0
    assert score(r"\boxed{5}", "$h=4$.") == score(r"\boxed{(0,1)}", "$(x, y)=(1,0)$.") == 0.0
    with pytest.raises(ValueError, match="does not match itself"):  # a formula inside prose stays refused
        check_label(r"$\min$ at $x=1$.")


def test_verifier_version_names_math_verify():
    from importlib.metadata import version

    assert VERIFIER_VERSION.startswith("caspo-")
    assert f"math-verify-{version('math-verify')}" in VERIFIER_VERSION


def test_verifier_module_does_not_import_torch():
    """Workers import only these modules; they must stay free of torch and other heavy packages."""
    code = ("import sys, caspo.reward.verify, caspo.reward.worker; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
