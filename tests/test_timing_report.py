"""The timing report of a run (caspo.report.timing) from planted metrics and run records; a real run's report is
checked in test_train_e2e."""

import json

import pytest

from caspo.report.timing import markdown, timing


def plant(run, rows, starts):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run.json").write_text(json.dumps({"format": "caspo-run-1", "starts": starts}))
    (run / "config.yaml").write_text("model:\n  policy: /models/Ouro-1.4B\n  revision: 574fa66c\n")


def test_phases_sum_the_step_timers_evaluation_and_refresh_rows(tmp_path):
    rows = [{"step": 0, "t_eval": 2.0},
            {"step": 1, "t_step": 10.0, "t_roll": 4.0, "t_reward": 1.0, "t_old": 0.5, "t_ref": 0.25, "t_value": 0.25,
             "t_value_update": 0.0, "t_pol": 3.0, "t_sync": 0.5, "t_ckpt": 1.5},
            {"step": 1, "refresh_value_model": "v", "t_refresh": 7.0},
            {"step": 2, "t_step": 6.0, "t_roll": 2.0, "t_reward": 1.0, "t_pol": 2.5, "t_sync": 0.5, "t_bench": 3.0}]
    starts = [{"started_at": "2026-12-01T10:00:00+0000", "step": 0, "world_size": 2, "precision": "fp16",
               "engine_dtype": "fp16", "device_name": "NVIDIA H200", "git": {"commit": "abc", "dirty": True},
               "cuda_alloc_conf": "expandable_segments:True",
               "packages": {"torch": "2.11.0"}, "load_at_start": {"cpus": 16, "load_1m": 9.0, "shared": True,
                                                                   "shared_why": "load 9.0 of 16 CPUs"},
               "end": {"ended_at": "2026-12-01T10:01:00+0000", "state": "stopped", "load_1m_mean": 8.5}},
              {"started_at": "2026-12-01T11:00:00+0000", "step": 1, "end": {"ended_at": "2026-12-01T11:00:30+0000",
                                                                             "state": "finished"}}]
    plant(tmp_path / "run", rows, starts)
    report = timing(tmp_path / "run")
    assert report["steps"] == 2 and report["step_seconds"] == 16.0
    assert list(report["seconds"].values()) == [6.0, 2.0, 0.75, 0.25, 0.0, 5.5, 1.0, 1.5, 5.0, 7.0]
    assert report["wall_seconds"] == 90.0  # 60 s, then a resumed process of 30 s
    assert report["outside_phases_seconds"] == pytest.approx(90.0 - 29.0)
    assert report["model"] == {"policy": "/models/Ouro-1.4B", "revision": "574fa66c"}
    text = markdown(report)
    assert "| rollout | 6.0 | 21% | 3.00 |" in text  # 6 of the 29 s in phases
    assert "| rest of the wall time (advantages, records, trackers, reward workers' start, curves; not model " \
           "loading) | 61.0 | | |" in text
    assert "- source: abc (uncommitted changes)" in text
    assert "precision fp16, engine fp16; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert text.count("PYTORCH_CUDA_ALLOC_CONF") == 1  # the second process recorded none
    assert "shared: load 9.0 of 16 CPUs" in text and "mean 8.5 during the steps" in text
    assert "## Process 2: from step 1, 1 rank(s)" in text and "at revision 574fa66c" in text


def test_each_row_holds_the_timers_its_label_names(tmp_path):
    """Value-model training is not scoring; the critic's step in the value phase is named where it is counted."""
    rows = [{"step": 1, "t_step": 9.0, "t_old": 1.0, "t_ref": 2.0, "t_value": 3.0, "t_value_update": 4.0}]
    plant(tmp_path / "run", rows, [])
    seconds = timing(tmp_path / "run")["seconds"]
    assert seconds["old and reference log-probs"] == 3.0
    assert seconds["values (critic, Monte Carlo, prefix model; a critic trained on its own values: its step)"] == 3.0
    assert seconds["value-model training after the advantages (CASPO's online step)"] == 4.0
    assert not any("scoring" in name for name in seconds)
