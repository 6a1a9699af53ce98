"""Training curves as PNGs, of one run or of groups of runs (seeds): the mean over a group's runs, with a
band of the 95% Student t interval of that mean where it has more than one run (`band`).

    plot_curves      reward, pass@G, held-out and benchmark accuracy, KL, length (against its cap), steps
                     per response, and (one group) its per-phase step times stacked
    plot_vs_compute  one metric against steps, samples, generated tokens and wall-clock
    plot_phases      per-phase seconds per step, stacked, a panel per group
    plot_run         a run's curves.png, written at the end of training (and readable from a crashed run)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from caspo.report.runs import PHASES, Run, aligned, read_run  # noqa: E402

Groups = dict[str, list[Run]]
X_LABELS = {"step": "outer step", "samples": "training samples", "tokens": "generated tokens",
            "wall_s": "wall-clock (s)"}


def band(ax, runs: list[Run], key: str, label: str, x: str = "step", style: str = "-", color=None) -> bool:
    """The mean of `key` over `runs` against `x`, ± the 95% t interval of the mean; False when no run logged it."""
    points = aligned(runs, key, x)
    if not points:
        return False
    xs = [p[0] for p in points]
    mean = [p[1]["mean"] for p in points]
    line, = ax.plot(xs, mean, style, label=label, color=color, marker="o" if len(xs) < 12 else None, markersize=3)
    if len(runs) > 1:
        ci = [p[1]["ci95"] for p in points]
        ax.fill_between(xs, [m - c for m, c in zip(mean, ci)], [m + c for m, c in zip(mean, ci)],
                        color=line.get_color(), alpha=0.2)
    return True


def bench_keys(groups: Groups) -> list[str]:
    return sorted({k for runs in groups.values() for run in runs for r in run.records for k in r
                   if k.startswith("bench_") and k.endswith("_greedy")})


def plot_curves(groups: Groups, out: str | Path, phases: bool = False) -> Path:
    panels = [("reward_mean", "mean training reward"), ("pass_at_g", "pass@G (groups with a correct sample)"),
              ("heldout", "held-out accuracy"), ("bench", "benchmarks, greedy"), ("kl", "KL to the reference"),
              ("response_len_mean", "response length (tokens)"), ("steps_per_response", "steps per response")]
    if phases:
        panels.append(("phases", "seconds per step, by phase"))
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    axes = axes.ravel()
    colors = {label: f"C{i}" for i, label in enumerate(groups)}
    for ax, (key, title) in zip(axes, panels):
        ax.set(title=title, xlabel="outer step")
        drew = False
        if key == "phases":
            runs = next(iter(groups.values()))
            drew = stack_phases(ax, runs)
        for label, runs in groups.items():
            c = colors[label]
            if key == "heldout":
                drew |= band(ax, runs, "eval_accuracy", f"{label} greedy", color=c)
                drew |= band(ax, runs, "eval_sampled_accuracy", f"{label} avg@k", style="--", color=c)
            elif key == "bench":
                for j, bench in enumerate(bench_keys(groups)):
                    name = bench.removeprefix("bench_").removesuffix("_greedy")
                    drew |= band(ax, runs, bench, f"{label} {name}", style=("-", "--", ":", "-.")[j % 4], color=c)
            elif key != "phases":
                drew |= band(ax, runs, key, label, color=c)
        if key in ("reward_mean", "pass_at_g", "heldout", "bench"):
            ax.set_ylim(-0.02, 1.02)
        if key == "response_len_mean" and drew:
            for label, runs in groups.items():
                ax.axhline(runs[0].config["rollout"]["max_new_tokens"], color=colors[label], ls=":", lw=1)
        if not drew:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif key not in ("phases",) and (len(groups) > 1 or key in ("heldout", "bench")):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return save(fig, out)


def stack_phases(ax, runs: list[Run]) -> bool:
    series = {p: aligned(runs, p) for p in PHASES}
    series = {p: s for p, s in series.items() if s and any(v["mean"] for _, v in s)}
    if not series:
        return False
    steps = [x for x, _ in next(iter(series.values()))]
    ax.stackplot(steps, *[[v["mean"] for _, v in s] for s in series.values()], labels=list(series), alpha=0.85)
    ax.legend(fontsize=7, loc="upper left")
    return True


def plot_vs_compute(groups: Groups, key: str, out: str | Path, title: str) -> Path:
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for ax, x in zip(axes, X_LABELS):
        for i, (label, runs) in enumerate(groups.items()):
            band(ax, runs, key, label, x=x, color=f"C{i}")
        ax.set(xlabel=X_LABELS[x], ylabel=title, title=f"{title} against {X_LABELS[x]}")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # a group whose runs never share a step draws no band
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out)


def plot_phases(groups: Groups, out: str | Path) -> Path:
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (label, runs) in zip(axes[0], groups.items()):
        if not stack_phases(ax, runs):
            ax.text(0.5, 0.5, "no phase times", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(title=label, xlabel="outer step", ylabel="seconds per step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, out)


def save(fig, out: str | Path) -> Path:
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run = read_run(run_dir)
    return plot_curves({run.name: [run]}, out or Path(run_dir) / "curves.png", phases=True)
