"""Trackers: TensorBoard events read back (scalars by group, histograms, the samples table, a resume's purge),
and the loggers a config may list."""

import importlib.util

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from caspo.config import ConfigError, load_config
from caspo.report.trackers import TensorBoardTracker, check_loggers, samples_markdown, tag


def events(folder) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tags_group_metrics_by_prefix():
    assert [tag(k) for k in ("reward_mean", "t_roll", "eval_accuracy", "bench_math500_greedy", "pass_at_g",
                             "mem_peak_gb", "refresh_seconds")] == [
        "train/reward_mean", "time/t_roll", "eval/eval_accuracy", "bench/bench_math500_greedy", "health/pass_at_g",
        "memory/mem_peak_gb", "refresh/refresh_seconds"]


def test_tensorboard_events_read_back(tmp_path):
    tracker = TensorBoardTracker(tmp_path, start_step=0)
    tracker.log({"step": 0, "eval_accuracy": 0.25, "t_eval": 1.5})
    for step in (1, 2):
        tracker.log({"step": step, "reward_mean": 0.1 * step, "skipped_steps": 0, "health": ["kl"],
                     "refresh_value_model": "path/not/a/number"})
        samples = [{"prompt_id": f"p{i}", "reward": 1.0, "length": 3, "finish_reason": "stop", "policy_version": 0,
                    "text": "a | b\nc"} for i in range(2)]
        tracker.log_batch(step, samples, {"advantages": torch.tensor([-1.0, 0.0, 1.0, 2.0])})
    tracker.close()
    acc = events(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, pytest.approx(0.1)),
                                                                          (2, pytest.approx(0.2))]
    assert [(e.step, e.value) for e in acc.Scalars("eval/eval_accuracy")] == [(0, 0.25)]
    assert "train/health" not in acc.Tags()["scalars"] and "train/refresh_value_model" not in acc.Tags()["scalars"]
    hist = acc.Histograms("hist/advantages")
    assert [h.step for h in hist] == [1, 2]
    assert (hist[0].histogram_value.min, hist[0].histogram_value.max, hist[0].histogram_value.num) == (-1, 2, 4)
    text = acc.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == samples_markdown(samples)
    assert "a \\| b ⏎ c" in text  # a cell cannot break the table


def test_a_resumed_tracker_replaces_the_steps_it_writes_again(tmp_path):
    first = TensorBoardTracker(tmp_path, start_step=0)
    for step in (1, 2, 3):
        first.log({"step": step, "reward_mean": float(step)})
    first.close()
    resumed = TensorBoardTracker(tmp_path, start_step=2)  # resumed from the checkpoint of step 2
    resumed.log({"step": 3, "reward_mean": 30.0})
    resumed.close()
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("train/reward_mean")] == [(1, 1.0), (2, 2.0),
                                                                                       (3, 30.0)]


def test_loggers_must_keep_jsonl_and_be_installed():
    with pytest.raises(ConfigError, match="leaves out jsonl"):
        check_loggers(load_config("tests", ["train.loggers=[tensorboard]"]))
    with pytest.raises(ConfigError, match=r"train.loggers\[0\]: expected one of"):
        load_config("tests", ["train.loggers=[mlflow]"])
    check_loggers(load_config("tests", ["train.loggers=[jsonl,tensorboard]"]))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"wandb is not installed: pip install 'caspo\[wandb\]'"):
            check_loggers(load_config("tests", ["train.loggers=[jsonl,wandb]"]))
