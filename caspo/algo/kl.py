"""Per-token KL estimators between the policy and a reference, from sampled log-probs."""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) for tokens sampled from π.

    With d = logp − logp_ref:

        k1   d                                   unbiased, can be negative
        k2   d² / 2                              gradient of KL(π‖ref) as a loss
        k3   exp(−d) + d − 1                     unbiased, ≥ 0, low variance;
             d clamped to [−20, 20], result to [−10, 10]
        abs  |d|

    No mask: aggregate the result with ``aggregate``.
    """
    d = logp - logp_ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)  # keeps exp(−d) finite
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
