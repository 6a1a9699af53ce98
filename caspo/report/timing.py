"""The end-to-end timing report every run writes (`<run>/timing.json`, `<run>/timing.md`): where its time
went (rollout, rewards, log-probs, values, value-model training, policy update, publications, checkpoints,
evaluation, refreshes, and the rest of its wall time), what it ran on (source pins, packages, dtypes, device)
and how busy the machine was (resource contention), read back from metrics.jsonl and run.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from caspo.report.runs import read_run, stamp_seconds

# report line -> the metrics' phase timers summed into it (caspo/train/loop.py says what each times)
PHASES = {
    "rollout": ("t_roll",),  # its decode graphs' captures included
    "rewards": ("t_reward",),
    "old and reference log-probs": ("t_old", "t_ref"),
    # t_value also holds the critic's training step where it trains on its own values (train.critic_values=auto,
    # one minibatch, μ = 1): the step's first forward gives the values
    "values (critic, Monte Carlo, prefix model; a critic trained on its own values: its step)": ("t_value",),
    "value-model training after the advantages (CASPO's online step)": ("t_value_update",),
    "policy update (and a critic trained with it)": ("t_pol",),
    "publications": ("t_sync",),
    "checkpoints": ("t_ckpt",),
    "evaluation": ("t_eval", "t_bench"),
    "value refreshes": ("t_refresh",),
}
# The wall time is from each process's start record, stamped once its models are loaded, to its end: what the
# phases leave of it is the work between them (advantages, records, trackers, the reward workers' start, curves).
OUTSIDE = "rest of the wall time (advantages, records, trackers, reward workers' start, curves; not model loading)"


def wall_seconds(starts: list[dict]) -> float:
    """The processes' wall time from start to end, summed over resumes (a process without an end: none)."""
    total = 0.0
    for s in starts:
        end = s.get("end", {}).get("ended_at")
        if end:
            total += stamp_seconds(end) - stamp_seconds(s["started_at"])
    return total


def timing(run_dir: str | Path) -> dict:
    run = read_run(run_dir)
    rows = run.records
    steps = [r for r in rows if "t_step" in r]
    phases = {name: round(sum(float(r.get(k, 0.0)) for r in rows for k in keys), 3) for name, keys in PHASES.items()}
    starts = (run.run_json or {}).get("starts", [])
    wall = wall_seconds(starts)
    model = run.config.get("model", {})
    return {
        "steps": len(steps),
        "model": {"policy": model.get("policy"), "revision": model.get("revision")},
        "seconds": phases,
        "step_seconds": round(sum(r["t_step"] for r in steps), 3),
        "wall_seconds": round(wall, 3),
        "outside_phases_seconds": round(max(0.0, wall - sum(phases.values())), 3) if wall else None,
        "starts": [{"started_at": s["started_at"], "step": s["step"], "world_size": s.get("world_size", 1),
                    "git": s.get("git"), "packages": s.get("packages"), "device_name": s.get("device_name"),
                    "precision": s.get("precision"), "engine_dtype": s.get("engine_dtype"),
                    "cuda_alloc_conf": s.get("cuda_alloc_conf"),
                    "load_at_start": s.get("load_at_start"), "end": s.get("end")} for s in starts],
    }


def contention(load: dict, end: dict) -> str:
    parts = [f"load {load.get('load_1m', '?')} of {load.get('cpus', '?')} CPUs at the start"]
    if "load_1m_mean" in end:
        parts.append(f"mean {end['load_1m_mean']} during the steps")
    if "gpu_used_mb_by_others" in load:
        parts.append(f"GPU memory used by others {load['gpu_used_mb_by_others']} MB")
    parts.append(f"shared: {load.get('shared_why', '')}" if load.get("shared") else "not shared")
    return ", ".join(parts)


def markdown(report: dict) -> str:
    steps, secs = report["steps"], report["seconds"]
    total = sum(secs.values()) or 1.0
    lines = [f"# Timing: {steps} step(s), {report['step_seconds']:.1f} s in steps, {report['wall_seconds']:.1f} s wall",
             "", f"Model: {report['model']['policy']}"
             f"{' at revision ' + report['model']['revision'] if report['model']['revision'] else ''}",
             "", "| phase | seconds | share | per step |", "|---|---:|---:|---:|"]
    for name, s in secs.items():
        lines.append(f"| {name} | {s:.1f} | {s / total:.0%} | {s / steps if steps else 0:.2f} |")
    if report["outside_phases_seconds"] is not None:
        lines.append(f"| {OUTSIDE} | {report['outside_phases_seconds']:.1f} | | |")
    for i, s in enumerate(report["starts"]):
        git, end = s.get("git") or {}, s.get("end") or {}
        packages = ", ".join(f"{k} {v}" for k, v in (s.get("packages") or {}).items())
        lines += ["", f"## Process {i + 1}: from step {s['step']}, {s['world_size']} rank(s), {s['started_at']}",
                  f"- source: {git.get('commit', 'unknown')}{' (uncommitted changes)' if git.get('dirty') else ''}",
                  f"- packages: {packages}",
                  f"- device: {s.get('device_name')}; precision {s.get('precision')}, engine {s.get('engine_dtype')}"
                  f"{'; PYTORCH_CUDA_ALLOC_CONF=' + s['cuda_alloc_conf'] if s.get('cuda_alloc_conf') else ''}",
                  f"- contention: {contention(s.get('load_at_start') or {}, end)}",
                  f"- ended: {end.get('state', 'running, or killed')}"]
    return "\n".join(lines) + "\n"


def write_timing(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    report = timing(run_dir)
    for name, text in (("timing.json", json.dumps(report, indent=1) + "\n"), ("timing.md", markdown(report))):
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, run_dir / name)
    return run_dir / "timing.md"
