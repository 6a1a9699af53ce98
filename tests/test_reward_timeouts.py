"""A call that math-verify's own alarm ends scores 0 and is counted (`verifier_timeouts`), inline and through
the worker pool, apart from the calls the pool kills (`timeouts`)."""

import pytest

from caspo.reward import RewardPool, TallyingScorer, Unscored, Verdict, judge, score
from caspo.reward.worker import verdict_of

# pytest-timeout's default "signal" method shares SIGALRM with math-verify; use threads.
pytestmark = pytest.mark.timeout(60, method="thread")

# Passes the pre-filter (30,103 digits) but math-verify works on it until its alarm fires.
SLOW = r"So the answer is \boxed{\sum_{k=1}^{10^5} k^{k}}."
RIGHT = r"So the answer is \boxed{42}."


def test_judge_says_when_math_verify_ran_out_of_time():
    assert judge(SLOW, "42", timeout_s=1) == Verdict(0.0, timed_out=True)
    assert score(SLOW, "42", timeout_s=1) == 0.0
    assert judge(RIGHT, "42", timeout_s=1) == Verdict(1.0, timed_out=False)
    assert judge(r"\boxed{\frac{1}{3}}", "0.5", timeout_s=1) == Verdict(0.0, timed_out=False)  # wrong, in time


def test_the_pool_counts_the_calls_math_verify_ended():
    with RewardPool(workers=2, timeout_s=1.0) as pool:
        result = pool.score([SLOW, RIGHT, SLOW, RIGHT], ["42"] * 4, [True] * 4)
    assert result.rewards == [0.0, 1.0, 0.0, 1.0]
    assert (result.verifier_timeouts, result.timeouts, result.crashes) == (2, 0, 0)  # no worker was killed


def test_inline_scoring_counts_them_too():
    result = RewardPool(workers=0, timeout_s=1.0).score([SLOW, RIGHT], ["42", "42"], [True, True])
    assert result.rewards == [0.0, 1.0] and result.verifier_timeouts == 1


def test_a_score_function_may_return_a_reward_or_a_verdict():
    assert verdict_of(1.0) == (1.0, False) and verdict_of(0) == (0.0, False)
    assert verdict_of(Verdict(0.0, True)) == (0.0, True)


def test_a_tallying_scorer_sums_what_each_batch_left_unscored():
    scorer = TallyingScorer(RewardPool(workers=0, timeout_s=1.0))
    assert scorer([SLOW, RIGHT], ["42", "42"], [True, True]) == [0.0, 1.0]
    assert scorer([RIGHT], ["42"], [True]) == [1.0]
    assert scorer.unscored == Unscored(verifier_timeouts=1)
    assert scorer.unscored.counts("mc_reward_") == {
        "mc_reward_timeouts": 0, "mc_reward_verifier_timeouts": 1, "mc_reward_crashes": 0,
        "mc_reward_over_budget": 0, "mc_reward_unscored": 1}
