"""pass@k, avg@k, maj@k and the answer normal form, against hand-computed values."""

from fractions import Fraction
from math import comb

import pytest

from caspo.eval.metrics import (
    avg_at_k,
    majority_vote,
    mean_pass_at_k,
    normalize_answer,
    pass_at_k,
    sample_metrics,
)


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a correct one
    (4, 0, 3, 0.0),
    (4, 4, 1, 1.0),
    (1000, 1, 1, 1 / 1000),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    n, c, k = 400, 150, 100
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(4000, 1, 1) == pytest.approx(1 / 4000)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_mean_pass_and_avg():
    assert mean_pass_at_k([2, 1, 4], 4, 2) == pytest.approx((5 / 6 + 1 / 2 + 1) / 3)
    assert avg_at_k([[1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1]]) == pytest.approx((0.5 + 0.25 + 1) / 3)


@pytest.mark.parametrize("raw, normal", [
    (" 1,000 ", "1000"), ("2.50", "2.5"), ("3.0", "3"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("5\\text{ cm}", "5cm"), ("{7}", "7"),
    ("$x+1$.", "x+1"), ("\\{1,2\\}", "\\{1,2\\}"), ("{1}+{2}", "{1}+{2}"), ("12,34", "12,34"),
])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_majority_vote_counts_normal_forms_and_breaks_ties_by_first_sample():
    assert majority_vote(["5", "1/2", "\\dfrac{1}{2}", "\\frac{1}{2}"]) == 2  # \frac{1}{2} twice
    assert majority_vote(["7", "3", "3", "7"]) == 0  # a tie: the answer seen first wins
    assert majority_vote(["3", "7", "7", "3"]) == 0
    assert majority_vote([None, "4", None, "9", "9"]) == 3  # missing and truncated answers do not vote
    assert majority_vote([None, None, ""]) is None


def test_sample_metrics_on_a_planted_set():
    rewards = [[1, 1, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    answers = [["1", "1", "5", "5"],  # tie: "1" first, correct
               ["7", "2", "7", None],  # "7" wins, wrong (the fourth sample was truncated)
               ["3", "3", "3.0", "3"],  # correct
               [None, None, None, None]]  # nothing to vote on: wrong
    m = sample_metrics(rewards, answers)
    assert m["avg@4"] == pytest.approx((0.5 + 0.25 + 1 + 0) / 4)
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    assert m["pass@2"] == pytest.approx((5 / 6 + 1 / 2 + 1 + 0) / 4)
    assert m["pass@3"] == pytest.approx((1 + 3 / 4 + 1 + 0) / 4)
    assert m["pass@4"] == pytest.approx(3 / 4)
    assert m["maj@4"] == pytest.approx(2 / 4)
    assert list(m) == ["avg@4", "pass@1", "pass@2", "pass@3", "pass@4", "maj@4"]
    with pytest.raises(ValueError, match="same number of samples"):
        sample_metrics([[1, 0], [1]], [["1", "2"], ["1"]])


def former_outer_braces_removed(text: str) -> str:
    """The brace peeling normalize_answer did before, one pair and one check of the rest at a time."""
    def balanced(inner: str) -> bool:
        depth = 0
        for ch in inner:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth < 0:
                return False
        return depth == 0

    while text.startswith("{") and text.endswith("}") and balanced(text[1:-1]):
        text = text[1:-1]
    return text


def test_outer_braces_come_off_as_before():
    import random

    from caspo.eval.metrics import _without_outer_braces

    rng = random.Random(0)
    cases = ["", "{}", "{{}}", "{}}", "{{}", "}{", "{a}{b}", "{{a}{b}}", "{{{x}}}", "{{x}+{y}}", "{x}}{{y}"]
    cases += ["".join(rng.choice("{{}}ab") for _ in range(rng.randrange(12))) for _ in range(5000)]
    for text in cases:
        assert _without_outer_braces(text) == former_outer_braces_removed(text), repr(text)


def test_deeply_nested_and_overlong_answers_are_cheap_to_vote_on():
    import time

    nested = "{" * 8000 + "1" + "}" * 8000  # peeling it pair by pair took 14 s
    start = time.perf_counter()
    assert normalize_answer(nested) == "1"
    assert majority_vote([nested] * 16) is None  # longer than reward.max_answer_chars: the verifier refuses it
    assert time.perf_counter() - start < 0.5


def test_answers_longer_than_the_verifier_reads_do_not_vote():
    long = "1" * 301  # past the default reward.max_answer_chars (300), so it scores 0
    assert majority_vote([long, long, "7"]) == 2
    assert majority_vote([long, long, "7"], max_answer_chars=400) == 0
    m = sample_metrics([[0, 0, 1]], [[long, long, "7"]], max_answer_chars=300)
    assert m["maj@3"] == 1.0
