"""The answers `caspo eval` records, and maj@k votes on, are the ones the verifier reads: reward.extractor
and reward.fallback decide them, as they decide the reward."""

import pytest

from caspo.config import load_config
from caspo.data.examples import Example
from caspo.eval.benchmarks import Suite
from caspo.eval.suite import Outputs, metrics_of, problem_records

TEXTS = ["The final answer is $41$. I hope it is correct. Or 42", "no box, the total is 7", r"so \boxed{3}"]


@pytest.mark.parametrize("extractor, fallback, greedy, samples", [
    ("boxed", "none", None, [None, None, "3"]),
    ("boxed", "last_number", "42", ["42", "7", "3"]),
    ("minerva", "none", "41", ["41", None, None]),
    ("minerva", "last_number", "41", ["41", "7", "3"]),  # no "final answer is" at all: the last number
])
def test_recorded_answers_follow_the_reward_extraction(extractor, fallback, greedy, samples):
    cfg = load_config("tests", [f"reward.extractor={extractor}", f"reward.fallback={fallback}"])
    suite = Suite("s", "s", [Example("p0", "q", "41")], [[1]])
    (record,) = problem_records(suite, Outputs(TEXTS[:1], [0.0], [True]), Outputs(TEXTS, [0.0] * 3, [True] * 3), 3,
                                cfg.reward)
    assert record["greedy_answer"] == greedy and record["answers"] == samples


def test_an_unfinished_response_has_no_answer_and_votes_count_the_extracted_answers():
    cfg = load_config("tests", ["reward.fallback=last_number"])
    suite = Suite("s", "s", [Example("p0", "q", "7")], [[1]])
    texts = [r"\boxed{7}", "it is 7", r"\boxed{7}", r"\boxed{5}"]
    sampled = Outputs(texts, [1.0, 1.0, 0.0, 0.0], [True, True, False, True])
    (record,) = problem_records(suite, Outputs(texts[:1], [1.0], [True]), sampled, 4, cfg.reward)
    assert record["answers"] == ["7", "7", None, "5"]
    assert metrics_of([record], 4)["maj@4"] == 1.0  # "7" has two votes, and the first of them scored 1
