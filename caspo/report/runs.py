"""A run folder read back for reports, as it is: running, finished, stopped or crashed.

    config.yaml     the run's config            metrics.jsonl  one record a step (+ evaluations, refreshes)
    run.json        what it ran on (starts)     status.json    its state, rewritten as it goes
    eval/*.json     benchmark results per checkpoint (`caspo eval`'s format)

Series over a run's steps, for curves against steps, samples, generated tokens and wall-clock:
    samples   step × responses per step
    tokens    Σ policy_tokens of the steps so far (older runs: response_len_mean × responses per step)
    wall_s    Σ over the records before of t_step + t_ckpt + t_eval + t_bench + t_refresh, + the record's
              own t_step and t_refresh (an evaluation is placed at the time it started)
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from caspo.eval.report import read_results
from caspo.runlog import read_jsonl, read_mapping, read_run_json, read_status

PHASES = ("t_roll", "t_reward", "t_old", "t_ref", "t_value", "t_value_update", "t_pol", "t_sync")  # inside t_step
WALL = ("t_step", "t_ckpt", "t_eval", "t_bench", "t_refresh")  # the parts of a run's wall-clock
X_AXES = ("step", "samples", "tokens", "wall_s")
CONFIG_SECTIONS = {"method": dict, "train": dict, "rollout": dict}  # what a comparison reads of config.yaml
CONFIG_FIX = "mend it (the run's resolved config, as `caspo config PRESET OVERRIDES` prints it)"


@dataclass
class Run:
    path: Path
    config: dict  # config.yaml as written (nested sections)
    records: list[dict]  # metrics.jsonl, a cut last line left out
    run_json: dict | None = None
    status: dict | None = None
    evals: list[dict] = field(default_factory=list)  # eval/<checkpoint>.json
    label: str = ""  # its group's name in a report

    @property
    def name(self) -> str:
        return self.path.name if self.path.name not in ("", ".") else str(self.path)

    @property
    def seed(self) -> int:
        return self.config["train"]["seed"]

    @property
    def steps(self) -> list[dict]:
        """The outer steps' records, by step."""
        return [r for r in self.records if "reward_mean" in r]

    @property
    def responses_per_step(self) -> int:
        r = self.config["rollout"]
        return r["prompts_per_step"] * r["samples_per_prompt"]

    @property
    def state(self) -> str:
        """finished, stopped, failed, stalled, running; crashed when status.json says running but its
        process on this host is gone; unknown without status.json (a run older than it)."""
        if self.status is None:
            return "unknown"
        state = self.status.get("state", "unknown")
        if state in ("running", "stalled") and self.status.get("pid") and self._host() == socket.gethostname() \
                and not pid_alive(self.status["pid"]):
            return "crashed"
        return state

    def _host(self) -> str | None:
        starts = (self.run_json or {}).get("starts") or [{}]
        return starts[-1].get("host")

    def series(self, key: str) -> list[tuple[dict, float]]:
        """(position, value) of every record holding `key`; position maps X_AXES to the record's x."""
        out, tokens, wall, tokens_seen = [], 0.0, 0.0, False
        for r in self.records:
            at = wall + r.get("t_step", 0.0) + r.get("t_refresh", 0.0)  # not counting its own evaluation
            wall += sum(r.get(k, 0.0) for k in WALL)
            if "reward_mean" in r:
                if "policy_tokens" in r:
                    tokens += r["policy_tokens"]
                    tokens_seen = True
                elif not tokens_seen:
                    tokens += r["response_len_mean"] * self.responses_per_step
            if key in r and isinstance(r[key], (int, float)):
                pos = {"step": r["step"], "samples": r["step"] * self.responses_per_step, "tokens": tokens,
                       "wall_s": at}
                out.append((pos, float(r[key])))
        return out

    def total(self, key: str) -> float:
        return float(sum(r.get(key, 0) for r in self.steps))

    def wall_s(self) -> float:
        return float(sum(r.get(k, 0.0) for r in self.records for k in WALL))

    def last_eval(self) -> dict | None:
        """The latest checkpoint's benchmark results (by step)."""
        stepped = [e for e in self.evals if e.get("step") is not None]
        return stepped[-1] if stepped else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_run(path: str | Path, label: str = "") -> Run:
    path = Path(path)
    if not (path / "metrics.jsonl").is_file() or not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path}: not a run folder (it needs config.yaml and metrics.jsonl, which a run "
                                "writes when it starts)")
    config = read_mapping(path / "config.yaml", fix=CONFIG_FIX)
    evals = read_results(path / "eval") if (path / "eval").is_dir() else []
    return Run(path=path, config=config, records=read_jsonl(path / "metrics.jsonl"), run_json=read_run_json(path),
               status=read_status(path), evals=evals, label=label)


def stamp_seconds(stamp: str) -> float:
    """Seconds since the epoch of a caspo.runlog.now() stamp, e.g. 2026-12-01T10:00:00-0500: at its own offset,
    whatever this machine's time zone (the run may have been written under another)."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()


def age_s(status: dict | None) -> float | None:
    """Seconds since status.json was last written (its updated_at), or None."""
    if not status or not status.get("updated_at"):
        return None
    return time.time() - stamp_seconds(status["updated_at"])


# ---------------------------------------------------------------- across seeds

T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)  # Student t, df = 1..10


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table to 10, then the Cornish-Fisher
    expansion around z = 1.96 (within 0.001 of the exact value from df = 11 on)."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def mean_std(values: list[float]) -> dict:
    """mean, sample std (n - 1), n, and the half-width of the 95% t interval of the mean (0 when n = 1)."""
    n = len(values)
    if n == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0, "ci95": math.nan}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "n": n, "ci95": t_975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0}


def aligned(runs: list[Run], key: str, x: str = "step") -> list[tuple[float, dict]]:
    """(mean x, mean_std of `key`) at every step all `runs` logged `key` at; x is one of X_AXES, averaged
    over the runs at that step."""
    by_run = [{pos["step"]: (pos[x], v) for pos, v in run.series(key)} for run in runs]
    common = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    return [(sum(d[s][0] for d in by_run) / len(by_run), mean_std([d[s][1] for d in by_run])) for s in common]


def final(run: Run, key: str, last: int = 1) -> float | None:
    """The mean of `key` over its last `last` records in the run, or None."""
    values = [v for _, v in run.series(key)][-last:]
    return sum(values) / len(values) if values else None
