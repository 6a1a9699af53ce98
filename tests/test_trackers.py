"""Trackers: TensorBoard events read back (scalars by group, histograms, the samples table, a resume's purge),
a W&B run rewound at a resume (on a stand-in for wandb), and the loggers a config may list."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from caspo.config import ConfigError, load_config
from caspo.report.trackers import (
    TensorBoardTracker,
    build_trackers,
    check_loggers,
    samples_markdown,
    tag,
    wandb_run_id,
)


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


class FakeWandb(types.ModuleType):
    """wandb as a resumed run meets it: the service keeps each run's history, a run continued (resume="allow")
    starts after its last step and ignores a step below that, and a rewind (resume_from="ID?_step=K") truncates
    the history after K and starts at K + 1 (wandb/core's runbranch). Each start leaves its folder under
    <dir>/wandb/, as wandb does. `refuse_rewind`: a server without the feature."""

    def __init__(self, refuse_rewind: bool = False):
        super().__init__("wandb")
        self.histories: dict[str, dict[int, dict]] = {}
        self.inits: list[dict] = []
        self.refuse_rewind = refuse_rewind

    def init(self, dir, id=None, resume=None, resume_from=None, **settings):
        self.inits.append({"id": id, "resume": resume, "resume_from": resume_from})
        if resume_from is not None:
            if self.refuse_rewind:
                raise RuntimeError("rewinding runs is not enabled")
            id, step = resume_from.split("?_step=")
            history = self.histories[id]
            for later in [s for s in history if s > int(step)]:
                del history[later]
            start = int(step) + 1
        else:
            history = self.histories.setdefault(id, {})
            start = max(history, default=-1) + 1
        (Path(dir) / "wandb" / f"offline-run-20261201_{len(self.inits):06d}-{id}").mkdir(parents=True)
        return FakeWandbRun(history, start)


class FakeWandbRun:
    def __init__(self, history: dict, start: int):
        self.history, self.start = history, start

    def log(self, data: dict, step: int) -> None:
        if step >= self.start:  # W&B drops (with a warning) a step below the run's current one
            self.history[step] = data

    def finish(self) -> None:
        pass


def crash_and_resume(run_dir, wandb, checkpoint_step=3):
    """A run logs steps 1-5 and crashes; resumed from its checkpoint of step 3, it does steps 4 and 5 again."""
    cfg, first_start = load_config("tests", ["train.loggers=[jsonl,wandb]"]), "2026-12-01T10:00:00+0000"
    [first] = build_trackers(cfg, run_dir, 0, first_start)
    for step in range(1, 6):
        first.log({"step": step, "reward_mean": float(step)})
    [resumed] = build_trackers(cfg, run_dir, checkpoint_step, first_start)
    for step in range(checkpoint_step + 1, 6):
        resumed.log({"step": step, "reward_mean": 10.0 * step})
    resumed.close()
    history = wandb.histories[wandb_run_id(run_dir, first_start)]
    return {step: data["train/reward_mean"] for step, data in history.items()}


def test_a_resumed_wandb_run_rewinds_to_the_checkpoint_and_keeps_the_steps_done_again(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    assert crash_and_resume(tmp_path, wandb) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0}
    run_id = wandb.inits[0]["id"]
    assert wandb.inits == [{"id": run_id, "resume": "allow", "resume_from": None},
                           {"id": None, "resume": None, "resume_from": f"{run_id}?_step=3"}]


def test_a_wandb_run_that_cannot_rewind_is_continued_with_a_warning(tmp_path, monkeypatch, capsys):
    wandb = FakeWandb(refuse_rewind=True)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    assert crash_and_resume(tmp_path, wandb) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}  # W&B's own behaviour
    assert [i["resume"] for i in wandb.inits] == ["allow", None, "allow"]
    assert "W&B could not rewind run" in " ".join(capsys.readouterr().err.split())


def test_a_resume_that_starts_logging_to_wandb_creates_its_run(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = load_config("tests", ["train.loggers=[jsonl,wandb]"])
    [tracker] = build_trackers(cfg, tmp_path, 3, "2026-12-01T10:00:00+0000")  # no earlier process logged to W&B
    tracker.log({"step": 4, "reward_mean": 1.0})
    run_id = wandb_run_id(tmp_path, "2026-12-01T10:00:00+0000")
    assert wandb.inits == [{"id": run_id, "resume": "allow", "resume_from": None}]  # no run to rewind
    assert wandb.histories == {run_id: {4: {"train/reward_mean": 1.0}}}
