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


BOX_TEXTS = [r"so \fbox{3}", r"so \boxed 3", r"so \boxed{3}", r"\boxedsymbol 3", "the total is 3", r"\boxed{3"]
BOXED = [True, True, True, False, False, True]  # a box the extractor reads; one cut off still counts as a box


def test_the_suite_and_the_heldout_eval_count_the_boxes_the_extractor_reads():
    from types import SimpleNamespace

    from caspo.eval.heldout import greedy_accuracy
    from caspo.reward import RewardResult
    from caspo.rollout.base import Completion

    cfg = load_config("tests")
    suite = Suite("s", "s", [Example(f"p{i}", "q", "3") for i in range(len(BOX_TEXTS))], [[1]] * len(BOX_TEXTS))
    n = len(BOX_TEXTS)
    records = problem_records(suite, Outputs(BOX_TEXTS, [0.0] * n, [True] * n),
                              Outputs([t for t in BOX_TEXTS for _ in range(2)], [0.0] * 2 * n, [True] * 2 * n), 2,
                              cfg.reward)
    assert [r["greedy_boxed"] for r in records] == BOXED and [r["boxed"] for r in records] == [[b, b] for b in BOXED]
    metrics = metrics_of(records, 2)
    assert metrics["greedy_boxed_rate"] == metrics["sampled_boxed_rate"] == pytest.approx(4 / 6)

    engine = SimpleNamespace(generate=lambda requests, sampling: [
        Completion([r.prompt_ids[0]], [0.0], "stop", 0) for r in requests])
    tokenizer = SimpleNamespace(decode=lambda tokens, skip_special_tokens: BOX_TEXTS[tokens[0]])
    pool = SimpleNamespace(score=lambda texts, labels, finished: RewardResult([0.0] * len(texts)))
    result = greedy_accuracy(engine, tokenizer, [[i] for i in range(n)], ["3"] * n, pool, max_new_tokens=4,
                             stop_token_ids=[])
    assert result.boxed_rate == pytest.approx(4 / 6)
