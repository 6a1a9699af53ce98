"""How well prefix values rank and predict Monte Carlo labels: pure functions of arrays.

Pooled Spearman ρ(V, p̂), within-response ρ(ΔV, Δp̂), ROC-AUC of V and accuracy of
σ(V/β) > 1/2 against the base rollout's outcome; the smoke gate (``outcome_gate``). Ties
get average ranks; undefined statistics are NaN. Label noise caps ρ: even the exact p scores a pooled ρ of only
≈ 0.3–0.45 at J = 16 on the embedded base policy. See docs/phase1_labels.md.
"""

from __future__ import annotations

import math

import numpy as np


def rankdata(x) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(len(x))
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + 1 + end) / 2  # mean of ranks start+1 … end
            start = end
    return ranks


def spearman(x, y) -> float:
    """ρ = Pearson correlation of the average ranks of x and y."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {x.shape} and {y.shape}")
    if len(x) < 2:
        return math.nan
    rx, ry = rankdata(x) - (len(x) + 1) / 2, rankdata(y) - (len(y) + 1) / 2
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom > 0 else math.nan


def roc_auc(scores, labels) -> float:
    """P(score of a positive > score of a negative), ties ½:  (R₊ − n₊(n₊+1)/2) / (n₊·n₋)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    positive = labels > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = rankdata(scores)[positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def within_group_deltas(values, targets, groups, positions) -> tuple[np.ndarray, np.ndarray]:
    """Differences between consecutive entries of each group, ordered by position:

        ΔV_i = V(b_{i+1}) − V(b_i),   Δp̂_i = p̂(b_{i+1}) − p̂(b_i)
    """
    values, targets = np.asarray(values, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    groups, positions = np.asarray(groups), np.asarray(positions)
    order = np.lexsort((positions, groups))
    same = groups[order][1:] == groups[order][:-1]
    dv = np.diff(values[order])[same]
    dt = np.diff(targets[order])[same]
    return dv, dt


def calibration_bins(predicted, targets, bins: int = 10) -> list[dict]:
    """Mean prediction and mean target in equal-width bins of the prediction over [0, 1]."""
    predicted, targets = np.asarray(predicted, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    index = np.clip((predicted * bins).astype(int), 0, bins - 1)
    out = []
    for b in range(bins):
        member = index == b
        if member.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(member.sum()),
                        "predicted": float(predicted[member].mean()), "target": float(targets[member].mean())})
    return out


def success_probability(values, beta: float) -> np.ndarray:
    """σ(V/β): the success probability a value on the β·Σ log-ratio scale stands for."""
    return 1.0 / (1.0 + np.exp(-np.asarray(values, dtype=np.float64) / beta))


def value_metrics(values, p_hat, outcome, groups, positions, beta: float) -> dict:
    """The judgement of a value model on labelled prefixes (see the module docstring).

    ``values`` are V (the value scale, β·Σ log-ratio), ``p_hat`` the MC labels,
    ``outcome`` the base rollouts' 0/1 rewards, ``groups`` a rollout id per prefix and
    ``positions`` the prefix lengths (for the within-rollout order).
    """
    values = np.asarray(values, dtype=np.float64)
    p_hat, outcome = np.asarray(p_hat, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    prob = success_probability(values, beta)
    eps = 1e-7
    clipped = np.clip(prob, eps, 1 - eps)
    dv, dp = within_group_deltas(values, p_hat, groups, positions)
    positive_rate = float(outcome.mean()) if len(outcome) else math.nan
    return {
        "n": int(len(values)),
        "spearman": spearman(values, p_hat),
        "within_response_spearman": spearman(dv, dp),
        "within_response_pairs": int(len(dv)),
        "auc_outcome": roc_auc(values, outcome),
        "accuracy_outcome": float(((prob > 0.5) == (outcome > 0.5)).mean()) if len(outcome) else math.nan,
        "majority_baseline": max(positive_rate, 1 - positive_rate),
        "bce": float(-(p_hat * np.log(clipped) + (1 - p_hat) * np.log(1 - clipped)).mean())
        if len(values) else math.nan,
        "mean_predicted": float(prob.mean()) if len(prob) else math.nan,
        "mean_p_hat": float(p_hat.mean()) if len(p_hat) else math.nan,
    }


def outcome_gate(values, outcomes, beta: float, threshold: float = 0.7) -> dict:
    """The seed's smoke gate of a value model (v_acc ≥ 0.7 on a 1-step CASPO rollout), with what it must be
    read against: values V of whole responses, their 0/1 outcomes R.

        v_acc             = mean[(σ(V/β) > 1/2) = (R > 1/2)]
        majority_baseline = max(q, 1 − q),  q = mean[R > 1/2]: the v_acc of always guessing the common outcome
        auc               = ROC-AUC of V against R (1/2: no ranking at all; NaN with one outcome class)
        passed            = v_acc ≥ threshold
        beats_majority    = v_acc > majority_baseline

    The seed's warning: with ~80% wrong rollouts, predicting "wrong" everywhere already scores v_acc ≈ 0.8,
    so a model can pass the gate and still carry no signal; AUC says whether it ranks outcomes at all.
    """
    values, outcomes = np.asarray(values, dtype=np.float64), np.asarray(outcomes, dtype=np.float64)
    if values.shape != outcomes.shape or values.ndim != 1 or not len(values):
        raise ValueError(f"outcome_gate needs one value per outcome, got shapes {values.shape} and {outcomes.shape}")
    right = outcomes > 0.5
    v_acc = float(((success_probability(values, beta) > 0.5) == right).mean())
    q = float(right.mean())
    majority = max(q, 1 - q)
    return {"n": int(len(values)), "v_acc": v_acc, "majority_baseline": majority, "positive_rate": q,
            "auc": roc_auc(values, outcomes), "threshold": threshold, "passed": v_acc >= threshold,
            "beats_majority": v_acc > majority}
