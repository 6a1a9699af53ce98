"""What an evaluation folder shows: the checkpoints' JSON read back, a summary table (rich, and
summary.md), and accuracy over checkpoints as a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

FORMAT = "caspo-eval-1"  # the "format" of a checkpoint's JSON


def read_results(out_dir: str | Path) -> list[dict]:
    """Every checkpoint result in the folder, by step (lone policies last, by name)."""
    results = []
    for path in sorted(Path(out_dir).glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("format") == FORMAT:
            results.append(data)
    return sorted(results, key=lambda r: (r["step"] is None, r["step"] or 0, r["checkpoint"]))


def headline(metrics: dict) -> list[str]:
    """The columns of a summary: greedy, then avg@K, pass@1, pass@K, maj@K where sampled."""
    keys = ["greedy"]
    ks = [k for k in metrics if k.startswith("avg@")]
    if ks:
        K = ks[0].split("@")[1]
        keys += [f"avg@{K}", "pass@1"] + ([f"pass@{K}"] if K != "1" else []) + [f"maj@{K}"]
    return keys


def columns(metrics: list[dict]) -> list[str]:
    """The headline columns of every result, in order of first appearance (a greedy-only result and a sampled
    one show the sampled columns too)."""
    keys = {key: None for m in metrics for key in headline(m)}
    return list(keys) or ["greedy"]


def summary_rows(results: list[dict]) -> list[tuple[str, str, int, dict]]:
    """(benchmark, checkpoint, n, metrics) for every benchmark of every result."""
    return [(name, r["checkpoint"], b["n"], b["metrics"])
            for r in results for name, b in r["benchmarks"].items()]


def summary_table(results: list[dict], title: str = "accuracy") -> Table:
    table = Table(title=title)
    rows = summary_rows(results)
    keys = columns([row[3] for row in rows])
    for col in ["benchmark", "checkpoint", "n", *keys]:
        table.add_column(col, justify="left" if col in ("benchmark", "checkpoint") else "right")
    for name, ckpt, n, m in sorted(rows, key=lambda row: row[0]):
        table.add_row(name, ckpt, str(n), *[f"{m[k]:.3f}" if k in m else "" for k in keys])
    return table


def group_table(benchmark: str, checkpoint: str, key: str, groups: dict) -> Table:
    """One benchmark's metrics by subject or by level."""
    first = next(iter(groups.values()))
    keys = headline(first)
    table = Table(title=f"{benchmark} by {key} ({checkpoint})")
    for col in [key, "n", *keys]:
        table.add_column(col, justify="left" if col == key else "right")
    for name, m in groups.items():
        table.add_row(name, str(m["n"]), *[f"{m[k]:.3f}" for k in keys])
    return table


def write_markdown(results: list[dict], path: Path) -> Path:
    rows = summary_rows(results)
    keys = columns([row[3] for row in rows])
    lines = ["| benchmark | checkpoint | n | " + " | ".join(keys) + " | greedy s.e. |",
             "|---|---|---:|" + "---:|" * (len(keys) + 1)]
    for name, ckpt, n, m in sorted(rows, key=lambda row: row[0]):
        cells = [f"{m[k]:.3f}" if k in m else "" for k in keys] + [f"{greedy_se(m['greedy'], n):.3f}"]
        lines.append(f"| {name} | {ckpt} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "greedy s.e.: the binomial standard error √(p(1−p)/n) of one checkpoint's greedy accuracy; two "
              "checkpoints scored on the same problems differ by less noise than their s.e. suggest (a paired "
              "comparison of the per-problem records is the test)."]
    differ = differing_settings(results)
    if differ:
        lines += ["", "The results were made with different settings:", ""]
        lines += [f"- {key}: " + "; ".join(f"{c} {v}" for c, v in by_checkpoint.items())
                  for key, by_checkpoint in differ.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def greedy_se(p: float, n: int) -> float:
    """The binomial standard error of an accuracy p over n problems."""
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def differing_settings(results: list[dict]) -> dict[str, dict[str, object]]:
    """setting -> {checkpoint: value} for every setting whose value is not the same in all results."""
    keys = {key: None for r in results for key in r.get("settings", {})}
    values = {key: {r["checkpoint"]: r.get("settings", {}).get(key) for r in results} for key in keys}
    return {key: v for key, v in values.items() if len({json.dumps(x, sort_keys=True) for x in v.values()}) > 1}


def plot_results(results: list[dict], path: Path) -> Path:
    """One panel per benchmark: greedy (and avg@K, pass@K, maj@K) against the checkpoint's step."""
    names = sorted({name for r in results for name in r["benchmarks"]})
    cols = min(3, max(1, len(names)))
    rows = (len(names) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    by_step = all(r["step"] is not None for r in results)  # else one tick per checkpoint, by name
    for ax, name in zip(axes.flat, names):
        points = [(r["step"] if by_step else i, r["benchmarks"][name]["metrics"])
                  for i, r in enumerate(results) if name in r["benchmarks"]]
        xs = [x for x, _ in points]
        if not by_step:
            ax.set_xticks(range(len(results)), [r["checkpoint"] for r in results], rotation=30, fontsize=8)
            ax.set_xlim(-0.5, len(results) - 0.5)
        for key, style in zip(columns([m for _, m in points]), ["o-", "s--", "^:", "v-.", "d--", "x-", "p:"]):
            if key == "pass@1":
                continue
            ax.plot(xs, [m.get(key, float("nan")) for _, m in points], style, label=key)
        ax.set(title=name, xlabel="step" if by_step else "checkpoint", ylabel="accuracy", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
