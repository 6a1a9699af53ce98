"""A run's health: what every step logs beyond the update's statistics, and detectors over the history.

Per step (`step_health`):
    pass_at_g            share of prompt groups with at least one correct sample (the verifier's rewards,
                         also when a control shuffled them)
    response_len_max     the longest response; response_len_cap_frac = mean length / rollout.max_new_tokens
    steps_per_response   mean steps of a response: the method's own split when it makes one (vineppo,
                         caspo), else the text splitter's count (method.step_splitter, after_final_box,
                         capped at method.max_steps)
    policy_tokens        tokens generated this step; value_tokens: prompt + response tokens a value model
                         (critic or prefix value model) read for the step's values
    t_roll_tokens_per_s  generated tokens / t_roll; t_step_tokens_per_s: generated tokens / t_step
    mem_allocated_gb, mem_reserved_gb, mem_peak_gb   CUDA only: at the step's end (the memory_rise detector
                                                     watches the first), and the peak over it
    mem_peak_reserved_gb                             CUDA only: the most the allocator reserved in the step
    mem_<phase>_peak_gb, mem_<phase>_peak_reserved_gb, mem_<phase>_reserved_gb
                                                     CUDA only: each phase's peaks and what it left reserved
                                                     (caspo.train.timers.PhaseTimer)
    mem_alloc_retries    CUDA only: allocations in the step that freed the allocator's cache and retried
    compiled_graphs      graphs torch.compile built in the step (train.compile meeting new shapes)

Detectors are pure functions of the step records so far, oldest first (each holds `step` and the
metrics above), returning a message or None; `HealthWatch` runs those train.health enables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from caspo.algo.groups import group_pass_rate
from caspo.batch import RolloutBatch
from caspo.config.schema import Config, ConfigError
from caspo.config.train_schema import HealthConfig
from caspo.device_memory import GIB
from caspo.segment import SPLITTERS, merge_after_final_box, splitter_name

if TYPE_CHECKING:
    from caspo.train.trainer import Trainer


# ---------------------------------------------------------------- what a step logs


def text_steps(cfg: Config, text: str) -> int:
    """Steps of one response by the run's text splitter (no token mapping: cheap enough for every step)."""
    m = cfg.method
    starts = SPLITTERS[splitter_name(cfg)](text) or [0]
    if m.after_final_box == "merge":
        starts = merge_after_final_box(text, starts) or [0]
    return min(len(starts), m.max_steps) if m.max_steps else len(starts)


def steps_per_response(cfg: Config, batch: RolloutBatch) -> float:
    if batch.step_mask is not None:
        return float(batch.step_mask.sum(-1).float().mean())
    counts = [text_steps(cfg, text) if n else 0 for text, n in zip(batch.texts, batch.response_lengths.tolist())]
    return sum(counts) / max(len(counts), 1)


def value_tokens(batch: RolloutBatch, stats: dict) -> int:
    """Tokens a value model read: the critic's values, or a prefix value model's step values (Monte Carlo
    values are engine tokens, counted as mc_tokens)."""
    read = batch.values is not None or (batch.step_values is not None and "mc_tokens" not in stats)
    return int(batch.attention_mask.sum()) if read else 0


def memory_stats(device: torch.device, stats: dict) -> dict:
    """At the step's end, and its peak: the largest of its phases' peaks (`stats`' mem_<phase>_peak_gb, each
    phase resetting the counter) and what came after the last phase."""
    if device.type != "cuda":
        return {}
    phases = [v for k, v in stats.items() if k.startswith("mem_") and k.endswith("_peak_gb")]
    reserved = [v for k, v in stats.items() if k.startswith("mem_") and k.endswith("_peak_reserved_gb")]
    return {"mem_allocated_gb": round(torch.cuda.memory_allocated(device) / GIB, 3),
            "mem_reserved_gb": round(torch.cuda.memory_reserved(device) / GIB, 3),
            "mem_peak_gb": max([round(torch.cuda.max_memory_allocated(device) / GIB, 3), *phases]),
            "mem_peak_reserved_gb": max([round(torch.cuda.max_memory_reserved(device) / GIB, 3), *reserved])}


def step_health(tr: "Trainer", batch: RolloutBatch, stats: dict) -> dict:
    """The health metrics of the step that produced `batch` and `stats` (docstring above)."""
    cfg = tr.cfg
    rewards = batch.true_rewards if batch.true_rewards is not None else batch.rewards
    lengths = batch.response_lengths.float()
    tokens = int(lengths.sum())
    out = {"pass_at_g": group_pass_rate(rewards, batch.group_ids),
           "response_len_max": int(lengths.max()) if batch.size else 0,
           "response_len_cap_frac": float(lengths.mean()) / cfg.rollout.max_new_tokens,
           "steps_per_response": steps_per_response(cfg, batch),
           "policy_tokens": tokens, "value_tokens": value_tokens(batch, stats)}
    for phase in ("t_roll", "t_step"):
        if stats.get(phase):
            out[f"{phase}_tokens_per_s"] = round(tokens / stats[phase], 1)
    return out | memory_stats(tr.device, stats)


# ---------------------------------------------------------------- detectors


def no_reward(history: list[dict], steps: int) -> Optional[str]:
    """Reward 0 and pass@G 0 in each of the last `steps` steps."""
    last = history[-steps:]
    if len(last) < steps or not all(r.get("reward_mean") == 0 and r.get("pass_at_g") == 0 for r in last):
        return None
    return (f"reward 0 and pass@G 0 for {steps} steps in a row (steps {last[0]['step']}-{last[-1]['step']}): no "
            "prompt group holds a correct sample. After a start with rewards this points to a broken weight "
            "publication (does samples.jsonl's policy_version advance?); check also the verifier (reward.*) and "
            "the labels. To go on, raise train.health.no_reward_steps or set train.health.no_reward=warn")


def slope(values: list[float]) -> float:
    """The least-squares slope of `values` against 0, 1, 2, ..."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    var = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(range(n), values)) / var if var else 0.0


def rise(history: list[dict], key: str, steps: int) -> Optional[tuple[float, float]]:
    """(first, last) of `key` over the last `steps` steps when it rose over them (a positive least-squares
    slope and the last value above the first), else None."""
    window = [r[key] for r in history[-(steps + 1):] if key in r]
    if len(window) < steps + 1 or not (window[-1] > window[0] and slope(window) > 0):
        return None
    return window[0], window[-1]


def length_rise(history: list[dict], steps: int, length_cap: int, fraction: float,
                steps_cap: int = 0) -> Optional[str]:
    """Response length, or steps per response, rising over `steps` steps to `fraction` of its cap. Steps have
    a cap when method.max_steps sets one; without it, rising steps count when the length is near its cap."""
    found = []
    length = rise(history, "response_len_mean", steps)
    if length and length[1] >= fraction * length_cap:
        found.append(f"response length rose from {length[0]:.1f} to {length[1]:.1f} tokens over the last {steps} "
                     f"steps, to {length[1] / length_cap:.0%} of rollout.max_new_tokens={length_cap}")
    n_steps = rise(history, "steps_per_response", steps)
    if n_steps and steps_cap and n_steps[1] >= fraction * steps_cap:
        found.append(f"steps per response rose from {n_steps[0]:.1f} to {n_steps[1]:.1f} over the last {steps} "
                     f"steps, to {n_steps[1] / steps_cap:.0%} of method.max_steps={steps_cap}")
    elif n_steps and not steps_cap and history[-1].get("response_len_mean", 0) >= fraction * length_cap:
        found.append(f"steps per response rose from {n_steps[0]:.1f} to {n_steps[1]:.1f} over the last {steps} "
                     f"steps, with responses at {history[-1]['response_len_mean']:.1f} of {length_cap} tokens")
    if not found:
        return None
    return ("; ".join(found) + ": responses filling the length cap are a sign of mode collapse (read the texts in "
            "samples.jsonl). To go on, set train.health.length_rise=warn or off, or raise "
            "train.health.rise_cap_fraction")


MEMORY_RISE_MIN_GIB = 0.01  # a mean rise a step below this is the batch's size moving, not a holding


def memory_rise(history: list[dict], steps: int) -> Optional[str]:
    """CUDA memory allocated at a step's end higher than at the step before, in each of the last `steps` steps,
    by at least MEMORY_RISE_MIN_GIB a step on average: something holds more memory every step."""
    window = [r["mem_allocated_gb"] for r in history[-(steps + 1):] if "mem_allocated_gb" in r]
    if len(window) < steps + 1 or not all(b > a for a, b in zip(window, window[1:])):
        return None
    per_step = (window[-1] - window[0]) / steps
    if per_step < MEMORY_RISE_MIN_GIB:
        return None
    return (f"memory allocated at the end of a step rose in each of the last {steps} steps, from {window[0]:.2f} to "
            f"{window[-1]:.2f} GiB (+{per_step:.3f} GiB a step): something holds more memory every step. "
            "`benchmarks/trainer_smoke.py --memory-growth DIR` names the lines that allocate it. To go on, set "
            "train.health.memory_rise=off or raise train.health.memory_rise_steps")


def kl_high(history: list[dict], bound: float) -> Optional[str]:
    """The last step's `kl` (the update's KL to the reference) above `bound`."""
    if not history or history[-1].get("kl") is None or not history[-1]["kl"] > bound:
        return None
    return (f"kl {history[-1]['kl']:.4g} at step {history[-1]['step']} is above train.health.kl_max={bound:g}: the "
            "policy has moved far from its reference (with an online value model: value drift). Lower optim.lr, "
            "raise method.kl_coef, or raise train.health.kl_max")


def non_finite(history: list[dict]) -> Optional[str]:
    """A NaN or infinity among the last step's numbers."""
    if not history:
        return None
    bad = [f"{k}={v}" for k, v in history[-1].items()
           if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return None
    return (f"non-finite metrics at step {history[-1]['step']}: {', '.join(bad)}. Look at the step's inputs "
            "(rewards, log-probs) and lower optim.lr or use train.precision=fp32; set train.health.nan=warn to go on")


# ---------------------------------------------------------------- running them


@dataclass(frozen=True)
class Alarm:
    detector: str  # a train.health key: no_reward, length_rise, kl, memory_rise, nan
    action: str  # "warn" or "stop"
    message: str


def check_config(h: HealthConfig) -> None:
    for key in ("no_reward_steps", "rise_steps", "memory_rise_steps"):
        if getattr(h, key) < 1:
            raise ConfigError(f"train.health.{key} must be >= 1, got {getattr(h, key)}")
    if not 0 < h.rise_cap_fraction <= 1:
        raise ConfigError(f"train.health.rise_cap_fraction must be in (0, 1], got {h.rise_cap_fraction}")
    if h.watchdog_s < 0:
        raise ConfigError(f"train.health.watchdog_s must be >= 0 (0 = no watchdog), got {h.watchdog_s}")


def detect(history: list[dict], cfg: Config) -> list[Alarm]:
    """Every enabled detector that fires on `history`."""
    h = cfg.train.health
    checks = {
        "no_reward": lambda: no_reward(history, h.no_reward_steps),
        "length_rise": lambda: length_rise(history, h.rise_steps, cfg.rollout.max_new_tokens, h.rise_cap_fraction,
                                           cfg.method.max_steps),
        "kl": lambda: kl_high(history, h.kl_max),
        "memory_rise": lambda: memory_rise(history, h.memory_rise_steps),
        "nan": lambda: non_finite(history),
    }
    alarms = []
    for name, check in checks.items():
        action = getattr(h, name)
        if action != "off" and (message := check()):
            alarms.append(Alarm(name, action, message))
    return alarms


def trailing_bad_steps(history: list[dict]) -> int:
    """How many of the last step records in a row skipped an update for non-finite gradients (`skipped_steps` is
    the run's running count): the streak that train.max_bad_steps counts, continued by a resumed run."""
    counts = [0] + [r["skipped_steps"] for r in history if "skipped_steps" in r]
    streak = 0
    while streak < len(counts) - 1 and counts[-1 - streak] > counts[-2 - streak]:
        streak += 1
    return streak


class HealthWatch:
    """The detectors step after step: a warning is given when its detector starts firing (not again while
    it keeps firing); a stop is returned whenever it fires."""

    def __init__(self, cfg: Config, history: list[dict] | None = None):
        """`history`: the step records of a resumed run; what fired at its last step is not warned again."""
        check_config(cfg.train.health)
        self.cfg, self.history = cfg, list(history or [])
        self.firing = {a.detector for a in detect(self.history, cfg)} if self.history else set()

    def check(self, record: dict) -> list[Alarm]:
        self.history.append(record)
        alarms = detect(self.history, self.cfg)
        new = [a for a in alarms if a.action == "stop" or a.detector not in self.firing]
        self.firing = {a.detector for a in alarms}
        return new
