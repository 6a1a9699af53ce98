"""Read a prefix value model's values at labelled prefixes, and judge them against the labels.

One forward per base rollout reads the values of all its labelled prefixes (the model
is causal): V(y_{<b}) = C[b − 1] of the rollout's cumulative values. The same reference
forward gives each prefix's ceiling, the highest success probability any φ on this
reference could give it (``caspo.models.prefix_value.probability_ceiling``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from caspo.models.forward import response_logprobs
from caspo.models.prefix_value import PrefixValueModel, pack_responses, prefix_values, probability_ceiling
from caspo.precision import autocast
from caspo.value.labels import LabelRow, ResponseLabels, group_responses, merge_duplicates
from caspo.value.metrics import calibration_bins, success_probability, value_metrics


def boundary_values(model: PrefixValueModel, responses: Sequence[ResponseLabels], pad_token_id: int,
                    device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V at every labelled boundary of each rollout, ``[B, N]``, the mask of real boundaries, and
    each boundary's probability ceiling ``[B, N]``."""
    batch = pack_responses([r.prompt_tokens for r in responses], [r.response_tokens for r in responses],
                           pad_token_id).to(device)
    N = max(len(r.boundaries) for r in responses)
    boundaries = torch.zeros(len(responses), N, dtype=torch.long)
    mask = torch.zeros(len(responses), N)
    for i, r in enumerate(responses):
        boundaries[i, :len(r.boundaries)] = torch.tensor(r.boundaries)
        mask[i, :len(r.boundaries)] = 1.0
    boundaries, mask = boundaries.to(device), mask.to(device)
    with torch.no_grad():
        ref = model.call(model.reference, response_logprobs, batch, 1.0)
    values = prefix_values(model.cumulative(batch, ref), boundaries)
    ref_prefix = prefix_values(torch.where(batch.response_mask.bool(), ref, 0.0).cumsum(-1), boundaries)
    return values, mask, probability_ceiling(ref_prefix)


def predict(model: PrefixValueModel, rows: Sequence[LabelRow], pad_token_id: int, batch_size: int = 32,
            device: str | torch.device = "cpu") -> np.ndarray:
    """V of every row's prefix, in row order (copies of one rollout read once)."""
    return read_prefixes(model, rows, pad_token_id, batch_size, device)[0]


@torch.no_grad()
def read_prefixes(model: PrefixValueModel, rows: Sequence[LabelRow], pad_token_id: int, batch_size: int = 32,
                  device: str | torch.device = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """V and the probability ceiling of every row's prefix, in row order."""
    out, ceiling = np.full(len(rows), math.nan), np.full(len(rows), math.nan)
    responses = merge_duplicates(group_responses(rows))
    for start in range(0, len(responses), batch_size):
        chunk = responses[start:start + batch_size]
        values, _, ceilings = boundary_values(model, chunk, pad_token_id, device)
        for i, r in enumerate(chunk):
            for indices in (r.rows, *r.duplicate_rows):
                out[indices] = values[i, :len(r.rows)].double().cpu().numpy()
                ceiling[indices] = ceilings[i, :len(r.rows)].double().cpu().numpy()
    return out, ceiling


def evaluate(model: PrefixValueModel, rows: Sequence[LabelRow], pad_token_id: int, batch_size: int = 32,
             device: str | torch.device = "cpu", precision: str = "fp32") -> tuple[dict, np.ndarray]:
    """``value_metrics`` of the model on ``rows``, and the values themselves, read under `precision` (a run's
    train.precision: bf16 reads V as a bf16 run does)."""
    if not rows:
        raise ValueError("no labelled prefixes to evaluate on")
    with autocast(precision, torch.device(device)):
        values, ceiling = read_prefixes(model, rows, pad_token_id, batch_size, device)
    groups = [rollout_id(r) for r in rows]
    metrics = value_metrics(values, [r.p_hat for r in rows], [r.base_reward for r in rows], groups,
                            [r.boundary for r in rows], model.beta)
    return {**metrics, **ceiling_metrics(ceiling, [r.p_hat for r in rows])}, values


def ceiling_metrics(ceiling, p_hat, margin: float = 0.05) -> dict:
    """How far the labels lie out of any φ's reach on this reference:

    - ``above_ceiling``: share of prefixes with p̂ > ceiling + margin;
    - ``mean_ceiling_sure``: the mean ceiling over prefixes with p̂ ≥ 0.9.
    """
    ceiling, p_hat = np.asarray(ceiling, dtype=np.float64), np.asarray(p_hat, dtype=np.float64)
    sure = p_hat >= 0.9
    return {
        "above_ceiling": float((p_hat > ceiling + margin).mean()),
        "mean_ceiling_sure": float(ceiling[sure].mean()) if sure.any() else math.nan,
    }


def rollout_id(row: LabelRow) -> int:
    """One integer per base rollout, ordered like (prompt index, sample)."""
    return row.prompt_index * 1_000_003 + row.sample


def write_report(out_dir: str | Path, metrics: dict, values: np.ndarray, rows: Sequence[LabelRow], beta: float,
                 title: str, extra: dict | None = None) -> tuple[Path, Path]:
    """metrics.json and calibration.png (binned σ(V/β) against MC p̂) in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    predicted = success_probability(values, beta)
    bins = calibration_bins(predicted, [r.p_hat for r in rows])
    metrics_path = out_dir / "metrics.json"
    metrics_path.write_text(json.dumps({**metrics, "calibration": bins, **(extra or {})}, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="calibrated")
    if bins:
        sizes = np.array([b["n"] for b in bins], dtype=float)
        ax.scatter([b["predicted"] for b in bins], [b["target"] for b in bins], s=20 + 200 * sizes / sizes.max(),
                   zorder=3, label="bins (area ∝ count)")
        ax.plot([b["predicted"] for b in bins], [b["target"] for b in bins], lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted σ(V/β)", ylabel="Monte Carlo p̂",
           title=f"{title}\nρ={metrics['spearman']:.3f}  within ρ={metrics['within_response_spearman']:.3f}  "
                 f"n={metrics['n']}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    plot_path = out_dir / "calibration.png"
    fig.savefig(plot_path, dpi=120)
    plt.close(fig)
    return metrics_path, plot_path
