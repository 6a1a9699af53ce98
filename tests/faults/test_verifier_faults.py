"""A reward worker that hangs or dies in the middle of a training batch: its call scores 0 and is counted,
the worker is replaced, and the run finishes every step."""

import dataclasses
import json
import os
from functools import partial

import pytest
from flaky_verifier import flaky_score

from caspo.config import load_config
from caspo.reward.pool import RewardPool
from caspo.train import loop, trainer

# the reward workers run math-verify; pytest-timeout's "signal" method would share their SIGALRM in-process
pytestmark = pytest.mark.timeout(300, method="thread")


def test_a_hung_and_a_crashed_reward_worker_cost_one_call_each_and_the_run_goes_on(tmp_path, monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    batches = []  # (worker pids before, the batch, the result, worker pids after) of every batch scored

    class FlakyPool(RewardPool):
        """The pool the trainer builds from its config, with the flaky score function in its workers."""

        @classmethod
        def from_config(cls, cfg, score_fn=None):
            return super().from_config(cfg, partial(flaky_score, marks=str(marks)))

        def score(self, responses, labels, finished):
            before = self.worker_pids()
            result = super().score(responses, labels, finished)
            batches.append((before, (responses, labels, finished), result, self.worker_pids()))
            return result

    monkeypatch.setattr(trainer, "RewardPool", FlakyPool)
    cfg = load_config("tests", [f"train.output_dir={tmp_path / 'run'}", "reward.timeout_s=1", "train.steps=2",
                                "eval.before=false", "eval.after=false", "model.threads=1"])
    loop.train(cfg)

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # every step ran
    assert [(r["reward_timeouts"], r["reward_crashes"]) for r in rows] == [(1, 1), (0, 0)]  # counted in its step's row
    assert rows[0]["t_reward_max_call"] > cfg.reward.timeout_s and rows[0]["mem_reward_worker_peak_mb"] > 10
    (before, batch, result, after), *rest = batches
    assert (result.timeouts, result.crashes) == (1, 1) and all(b[2].timeouts == b[2].crashes == 0 for b in rest)
    # one worker: calls 0 and 1 on the first worker (1 hangs), 2 and 3 on its replacement (3 crashes), then a third
    expected = RewardPool.from_config(dataclasses.replace(cfg.reward, workers=0)).score(*batch).rewards
    expected[1] = expected[3] = 0.0
    assert result.rewards == expected and len(expected) == cfg.responses_per_step == 8
    hung, crashed = (int((marks / name).read_text()) for name in ("hang", "crash"))
    assert before == [hung]  # the batch began on the worker that hung ...
    assert hung not in after and crashed not in after and len(after) == 1  # ... replaced, as was the crashed one
    for pid in (hung, crashed):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
    assert result.max_call_s < cfg.reward.timeout_s + 2  # the hang cost one call's limit (+ 1 s grace)
    assert ckpt_step(tmp_path / "run") == 2


def ckpt_step(run_dir) -> int:
    from caspo.train import checkpoint as ckpt

    return int(ckpt.resolve_checkpoint(run_dir).name.split("_")[1])
