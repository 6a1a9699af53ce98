"""Training curves as a PNG: mean reward per step and held-out accuracy at each evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_r.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], color="tab:blue")
    ax_r.set(xlabel="outer step", ylabel="mean training reward", title="reward", ylim=(0, 1))
    eval_steps = [r["step"] for r in evals]
    ax_a.plot(eval_steps, [r["eval_accuracy"] for r in evals], "o-", color="tab:green", label="greedy accuracy")
    ax_a.plot(eval_steps, [r["eval_boxed_rate"] for r in evals], "s--", color="tab:gray", label="boxed rate")
    sampled = [r for r in evals if "eval_sampled_accuracy" in r]
    if sampled:
        ax_a.plot([r["step"] for r in sampled], [r["eval_sampled_accuracy"] for r in sampled], "^-", color="tab:orange",
                  label="sampled avg@k")
    ax_a.set(xlabel="outer step", ylabel="held-out accuracy", title="held-out (greedy unless marked)", ylim=(0, 1.02))
    ax_a.legend(loc="lower right")
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
