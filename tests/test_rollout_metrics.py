"""The rollout phase reports the decode graphs the native engine captured inside it (each wake drops them)."""

import pytest
import torch

from caspo.config import load_config
from caspo.train import loop
from caspo.train.verify_resume import _measured

pytestmark = pytest.mark.timeout(240)


def trainer(tmp_path, backend):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", f"rollout.backend={backend}",
                                "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"])
    return loop.build_trainer(cfg)


def logged(batch):
    batch.rewards = torch.zeros(batch.size)
    batch.old_logprobs = batch.behaviour_logprobs
    return loop.batch_stats(batch)


def test_a_rollout_logs_the_captures_made_during_it_and_not_before(tmp_path, monkeypatch):
    tr = trainer(tmp_path, "native")
    stats = tr.engine.stats
    stats.graph_captures, stats.capture_s = 5, 2.0  # an earlier phase's captures: not the rollout's
    generate = tr.engine.generate

    def capturing(*args, **kwargs):  # as a CUDA engine after a wake: three shapes captured again
        stats.graph_captures += 3
        stats.capture_s += 0.25
        return generate(*args, **kwargs)

    monkeypatch.setattr(tr.engine, "generate", capturing)
    with tr.pool:
        metrics = logged(loop.generate(tr, tr.cursor.take(2)))
    assert metrics["roll_graph_captures"] == 3
    assert metrics["t_roll_capture"] == pytest.approx(0.25)


def test_an_eager_engine_captures_nothing_and_an_engine_without_counters_logs_no_key(tmp_path):
    tr = trainer(tmp_path / "native", "native")
    with tr.pool:
        assert logged(loop.generate(tr, tr.cursor.take(2)))["roll_graph_captures"] == 0  # the CPU runs eagerly
    tr = trainer(tmp_path / "hf", "hf")
    with tr.pool:
        metrics = logged(loop.generate(tr, tr.cursor.take(2)))
    assert "roll_graph_captures" not in metrics and "t_roll_capture" not in metrics


def test_capture_counts_are_left_out_of_the_resume_comparison():
    # a resumed process captures every shape again where an uninterrupted one (engine awake) may not
    assert _measured("roll_graph_captures") and _measured("mc_graph_captures") and _measured("t_roll_capture")
    assert not _measured("reward_mean") and not _measured("mc_tokens")
