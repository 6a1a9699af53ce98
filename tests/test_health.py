"""Health: pass@G, the detectors on hand-made histories, the watchdog, and planted runs for every detector:
one stopped by no_reward (reward forced to 0; checkpoint, status.json, run.json and TensorBoard events read back),
one warned of KL and of lengths climbing to the cap, one stopped by non-finite metrics (NaN rewards)."""

import json
import time

import pytest
import torch

from caspo.algo.groups import group_pass_rate
from caspo.config import ConfigError, load_config
from caspo.runlog import StatusFile, read_jsonl
from caspo.train import checkpoint as ckpt
from caspo.train import health, loop
from caspo.train.watchdog import Watchdog

pytestmark = pytest.mark.timeout(240)


def steps(key_values: dict[str, list[float]], **const) -> list[dict]:
    """Step records 1..n, `key_values` giving each key's value per step."""
    n = len(next(iter(key_values.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in key_values.items()}, **const} for i in range(n)]


def test_pass_at_g_counts_groups_with_a_correct_sample():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert group_pass_rate(rewards, groups) == pytest.approx(2 / 4)
    assert group_pass_rate(torch.zeros(4), torch.tensor([0, 0, 1, 1])) == 0.0
    assert group_pass_rate(torch.ones(3), torch.tensor([5, 9, 9])) == 1.0  # ids need not be 0..n-1


def test_no_reward_fires_after_n_steps_of_zero_reward_and_zero_pass_at_g():
    zero = steps({"reward_mean": [0.2, 0, 0, 0], "pass_at_g": [0.5, 0, 0, 0]})
    assert health.no_reward(zero[:3], 3) is None  # only two zero steps so far
    message = health.no_reward(zero, 3)
    assert "reward 0 and pass@G 0 for 3 steps in a row (steps 2-4)" in message
    assert "train.health.no_reward_steps" in message
    some = steps({"reward_mean": [0, 0, 0], "pass_at_g": [0, 0.25, 0]})
    assert health.no_reward(some, 3) is None


def test_length_rise_fires_when_lengths_climb_to_the_cap():
    cap = 100
    climbing = steps({"response_len_mean": [40, 55, 70, 82, 91]})
    message = health.length_rise(climbing, 4, cap, 0.8)
    assert "response length rose from 40.0 to 91.0 tokens over the last 4 steps, to 91% of" in message
    assert health.length_rise(climbing, 4, cap, 0.95) is None  # not near enough to the cap
    assert health.length_rise(climbing[:4], 4, cap, 0.8) is None  # window not full
    flat_high = steps({"response_len_mean": [95, 94, 95, 94, 95]})
    assert health.length_rise(flat_high, 4, cap, 0.8) is None  # at the cap but not rising
    falling = steps({"response_len_mean": [99, 97, 90, 88, 85]})
    assert health.length_rise(falling, 4, cap, 0.8) is None


def test_steps_per_response_rising_fires_against_max_steps_or_with_the_length_at_its_cap():
    rising = {"steps_per_response": [3, 4, 6, 8]}
    short = steps(rising, response_len_mean=30.0)
    assert health.length_rise(short, 3, 100, 0.8) is None  # no max_steps and the length is far from its cap
    assert "steps per response rose from 3.0 to 8.0" in health.length_rise(short, 3, 100, 0.8, steps_cap=10)
    assert health.length_rise(short, 3, 100, 0.8, steps_cap=20) is None  # 8 of 20 is not near
    long = steps(rising, response_len_mean=90.0)
    assert "with responses at 90.0 of 100 tokens" in health.length_rise(long, 3, 100, 0.8)


def test_kl_bound_and_non_finite_metrics():
    history = steps({"kl": [0.1, 2.5]})
    assert health.kl_high(history[:1], 1.0) is None
    assert "kl 2.5 at step 2 is above train.health.kl_max=1" in health.kl_high(history, 1.0)
    assert health.kl_high(steps({"reward_mean": [0.5]}), 1.0) is None  # no KL logged: nothing to judge
    bad = steps({"pg_loss": [0.1, float("nan")], "grad_norm": [1.0, float("inf")], "reward_mean": [0.5, 0.5]})
    assert health.non_finite(bad[:1]) is None
    assert "non-finite metrics at step 2: pg_loss=nan, grad_norm=inf" in health.non_finite(bad)


def test_memory_rising_every_step_is_a_leak_and_the_batch_moving_is_not():
    leak = steps({"mem_allocated_gb": [37.5 + 0.16 * i for i in range(6)]})  # the capture-stream leak's rate
    assert health.memory_rise(leak[:5], 5) is None  # window not full
    message = health.memory_rise(leak, 5)
    assert "rose in each of the last 5 steps, from 37.50 to 38.30 GiB (+0.160 GiB a step)" in message
    assert "--memory-growth" in message and "train.health.memory_rise" in message
    dip = steps({"mem_allocated_gb": [37.5, 37.7, 37.9, 37.85, 38.1, 38.3]})
    assert health.memory_rise(dip, 5) is None  # one step gave memory back: not a holding every step
    batch_sizes = steps({"mem_allocated_gb": [37.5 + 0.001 * i for i in range(6)]})
    assert health.memory_rise(batch_sizes, 5) is None  # 1 MiB a step: the batch, under MEMORY_RISE_MIN_GIB
    assert health.memory_rise(steps({"reward_mean": [0.5] * 6}), 5) is None  # a CPU run logs no memory
    cfg = load_config("tests", ["train.health.memory_rise_steps=5"])
    assert [a.detector for a in health.detect(leak, cfg)] == ["memory_rise"]  # on by default, as a warning
    assert health.detect(leak, load_config("tests", ["train.health.memory_rise=off",
                                                     "train.health.memory_rise_steps=5"])) == []


def test_health_watch_warns_at_onset_stops_every_time_and_remembers_a_resumed_history():
    cfg = load_config("tests", ["train.health.kl=warn", "train.health.kl_max=1.0", "train.health.nan=stop"])
    watch = health.HealthWatch(cfg)
    kl = [0.5, 2.0, 3.0, 0.5, 4.0]
    fired = [[a.detector for a in watch.check({"step": i + 1, "kl": v})] for i, v in enumerate(kl)]
    assert fired == [[], ["kl"], [], [], ["kl"]]  # warned when it starts, again after it cleared
    stops = [watch.check({"step": 6, "kl": 0.1, "pg_loss": float("nan")}),
             watch.check({"step": 7, "kl": 0.1, "pg_loss": float("nan")})]
    assert [[(a.detector, a.action) for a in s] for s in stops] == [[("nan", "stop")]] * 2
    resumed = health.HealthWatch(cfg, [{"step": 1, "kl": 2.0}])  # kl was firing at the resumed step
    assert resumed.check({"step": 2, "kl": 2.5}) == []
    off = health.HealthWatch(load_config("tests", ["train.health.kl=off", "train.health.kl_max=1.0"]))
    assert off.check({"step": 1, "kl": 5.0}) == []
    with pytest.raises(ConfigError, match="train.health.rise_cap_fraction must be in"):
        health.HealthWatch(load_config("tests", ["train.health.rise_cap_fraction=1.5"]))


def test_watchdog_marks_a_stall_and_clears_it_at_the_next_step(tmp_path):
    status = StatusFile(tmp_path / "status.json", total_steps=5)
    status.update()
    with Watchdog(status, timeout_s=0.2, poll_s=0.02) as dog:
        dog.beat(1)
        time.sleep(0.5)
        stalled = json.loads((tmp_path / "status.json").read_text())
        dog.beat(2)
        running = json.loads((tmp_path / "status.json").read_text())
    assert stalled["state"] == "stalled" and stalled["step"] == 1
    assert "no outer step for" in stalled["message"] and "since step 1 finished" in stalled["message"]
    assert running["state"] == "running" and running["step"] == 2 and running["message"] == ""


def test_a_planted_zero_reward_run_stops_with_a_checkpoint(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=4", "eval.before=false",
                                "eval.after=false", "train.health.no_reward_steps=2", "rollout.prompts_per_step=2",
                                "rollout.max_new_tokens=16", "train.log_samples=3",
                                "train.loggers=[jsonl,tensorboard]"])
    monkeypatch.setattr(loop, "reward", lambda tr, batch: torch.zeros(batch.size, device=tr.device))
    with pytest.raises(loop.RunStopped, match="(?s)stopped itself after step 2.*train.health.no_reward: reward 0"):
        loop.train(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r.get("health") for r in rows] == [None, ["no_reward"]]
    assert all(r["reward_mean"] == 0 and r["pass_at_g"] == 0 for r in rows)
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_000002"  # the stop saved the step it was in
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and "no_reward" in status["message"]
    start = json.loads((tmp_path / "run.json").read_text())["starts"][0]
    assert start["end"]["state"] == "stopped" and start["end"]["step"] == 2
    assert start["device"] == "cpu" and start["precision"] == "fp32" and start["world_size"] == 1
    assert "cuda_alloc_conf" not in start  # the CUDA allocator's setting is recorded on CUDA devices only
    assert {"torch", "transformers", "caspo"} <= set(start["packages"]) and "load_1m" in start["load_at_start"]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    for key in ("reward_mean", "kl", "response_len_mean"):
        group = "health" if key.startswith("response_len") else "train"
        got = [(e.step, e.value) for e in events.Scalars(f"{group}/{key}")]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-7)) for r in rows], key
    assert [e.step for e in events.Histograms("hist/advantages")] == [1, 2]
    assert [e.step for e in events.Histograms("hist/update_ratio")] == [1, 2]
    table = events.Tensors("samples/text_summary")  # the text plugin stores the markdown as a string tensor
    assert [e.step for e in table] == [1, 2]
    text = table[0].tensor_proto.string_val[0].decode()
    assert text.startswith("| prompt_id | reward |") and len(text.splitlines()) == 2 + cfg.train.log_samples


def test_planted_runs_warn_of_kl_and_rising_lengths_and_go_on(tmp_path, monkeypatch):
    """A KL bound below any real KL, and response lengths planted to climb to the cap from step 2 on: both warn
    at their onset (recorded in the step's `health`), and the run goes on to its last step. Rewards are planted
    too, so that the updates move the policy away from its reference."""
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=5", "eval.before=false",
                                "eval.after=false", "rollout.max_new_tokens=16", "train.health.kl_max=1e-12",
                                "train.health.no_reward=off", "train.health.rise_steps=3",
                                "train.health.rise_cap_fraction=0.8"])
    planted = iter([2.0, 4.0, 8.0, 14.0, 15.0])  # mean length per step: 14 is past 0.8 of the cap of 16
    real = loop.batch_stats
    monkeypatch.setattr(loop, "batch_stats", lambda batch: {**real(batch), "response_len_mean": next(planted)})
    monkeypatch.setattr(loop, "reward", lambda tr, batch: (torch.arange(batch.size, device=tr.device) % 2).float())
    loop.train(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "t_step" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    onset = next(i for i, r in enumerate(rows) if r["kl"] > 1e-12)
    assert "kl" in rows[onset].get("health", []) and all("kl" not in r.get("health", []) for r in rows[:onset])
    assert [("length_rise" in r.get("health", [])) for r in rows] == [False, False, False, True, False]  # onset


def test_a_planted_non_finite_run_stops_before_saving_non_finite_weights(tmp_path, monkeypatch):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=3", "eval.before=false",
                                "eval.after=false", "rollout.max_new_tokens=16", "train.max_bad_steps=0"])
    monkeypatch.setattr(loop, "reward", lambda tr, batch: torch.full((batch.size,), float("nan"), device=tr.device))
    with pytest.raises(loop.RunStopped, match="(?s)stopped itself after step 1.*train.health.nan: non-finite metrics"):
        loop.train(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[0]["health"] == ["nan"]
    saved = ckpt.resolve_checkpoint(tmp_path)  # the update was skipped: the weights are finite and saved
    assert saved.name == "step_000001"
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "stopped"


@pytest.mark.parametrize("counts, streak", [([], 0), ([0, 0, 1, 2], 2), ([1], 1), ([0, 1, 1], 0), ([2, 3, 5], 3)])
def test_a_resumed_run_continues_the_streak_of_skipped_updates(counts, streak):
    """train.max_bad_steps counts outer steps in a row whose update was skipped; `skipped_steps` is the running
    count of skipped optimizer steps (several in one outer step count once), records without it are others'."""
    history = [{"step": i + 1, "skipped_steps": c} for i, c in enumerate(counts)] + [{"step": 0, "eval_n": 5}]
    assert health.trailing_bad_steps(history) == streak
