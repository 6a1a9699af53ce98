"""Answers the verifier left without a verdict (timed out, crashed, over the batch budget) count as wrong;
every path that scores says how many there were: a benchmark's result, the held-out metrics, the Monte
Carlo values' counters and the training step's."""

import json
import logging
from types import SimpleNamespace

import pytest

from caspo.config import load_config
from caspo.data.examples import Example
from caspo.eval.benchmarks import Suite
from caspo.eval.heldout import greedy_accuracy
from caspo.eval.suite import evaluate_suite
from caspo.reward import RewardPool, Verdict
from caspo.rollout.base import Completion, SamplingParams

pytestmark = pytest.mark.timeout(300, method="thread")

ENGINE = SimpleNamespace(generate=lambda requests, sampling: [Completion([0], [0.0], "stop", 0) for _ in requests])
TOKENIZER = SimpleNamespace(decode=lambda tokens, skip_special_tokens: r"so \boxed{3}")
NO_BUDGET = 1e-9  # the batch's time is up before its first call: every answer is over budget


def nothing_lost(**counts) -> dict:
    out = {"timeouts": 0, "verifier_timeouts": 0, "crashes": 0, "over_budget": 0} | counts
    return out | {"unscored": sum(out.values())}


def benchmark(pool) -> dict:
    cfg = load_config("tests", ["eval.samples=2"])
    suite = Suite("s", "s", [Example(f"p{i}", "q", "3") for i in range(2)], [[1], [2]])
    result, _ = evaluate_suite(ENGINE, TOKENIZER, pool, cfg, suite, SamplingParams())
    return result


def test_a_benchmark_result_counts_the_answers_its_scoring_lost(caplog):
    scored = benchmark(RewardPool(workers=0))
    assert scored["metrics"]["greedy"] == scored["metrics"]["avg@2"] == 1.0 and scored["scoring"] == nothing_lost()

    with caplog.at_level(logging.WARNING):
        lost = benchmark(RewardPool(workers=0, batch_budget_s=NO_BUDGET))
    assert lost["metrics"]["greedy"] == lost["metrics"]["avg@2"] == 0.0
    assert lost["scoring"] == nothing_lost(over_budget=6)  # 2 greedy + 2 × 2 sampled
    assert "s: 6 of 6 completions were not scored (6 over_budget) and count as wrong" in caplog.text


def test_the_held_out_metrics_count_them():
    run = dict(max_new_tokens=4, stop_token_ids=[])
    scored = greedy_accuracy(ENGINE, TOKENIZER, [[1], [2]], ["3", "3"], RewardPool(workers=0), **run).summary()
    assert scored["accuracy"] == 1.0 and scored["reward_unscored"] == 0
    lost = greedy_accuracy(ENGINE, TOKENIZER, [[1], [2]], ["3", "3"], RewardPool(workers=0, batch_budget_s=NO_BUDGET),
                           **run).summary()
    assert lost["accuracy"] == 0.0 and (lost["reward_over_budget"], lost["reward_unscored"]) == (2, 2)


def always_timed_out(response, label, finished=True, timeout_s=None, **options) -> Verdict:
    return Verdict(0.0, timed_out=True)


def test_training_and_monte_carlo_values_log_the_verifiers_timeouts(tmp_path, monkeypatch):
    from caspo.train import loop, trainer

    class TimingOutPool(RewardPool):
        """The pool the trainer builds, with a verifier whose alarm ends every call."""

        @classmethod
        def from_config(cls, cfg, score_fn=None):
            return super().from_config(cfg, always_timed_out)

    monkeypatch.setattr(trainer, "RewardPool", TimingOutPool)
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=1", "method.name=vineppo",
                                "method.vineppo_k=2", "reward.workers=0", "eval.before=true", "eval.after=false",
                                "eval.heldout_size=4", "rollout.max_new_tokens=16", "eval.max_new_tokens=8"])
    loop.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "t_step" in r]
    assert step["reward_verifier_timeouts"] == cfg.responses_per_step
    assert step["mc_requests"] > 0
    assert step["mc_reward_verifier_timeouts"] == step["mc_reward_unscored"] == step["mc_requests"]
    (held_out,) = [r for r in rows if "eval_accuracy" in r]
    assert held_out["eval_reward_verifier_timeouts"] == held_out["eval_n"] == 4
