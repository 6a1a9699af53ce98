"""IPVRM's balancing of online value-model updates (Gao et al., arXiv 2604.13197, §3.3, Eq. 15).

Online rollouts are label-imbalanced: easy prompts give mostly correct answers, hard ones mostly wrong.
For prompt x with G rollouts and outcomes r ∈ [0, 1], μ(x) = (1/G) Σ_g r_g, and

    ADB (Adaptive Difficulty Boundary):  V(x) = logit(μ(x)) is added to every logit of the sample's BCE,
                                         moving the decision boundary by the prompt's difficulty
    DLW (Dynamic Loss Weighting):        w = 1 − μ(x) for a correct sample (r > 1/2), w = μ(x) for a wrong
                                         one: the rarer outcome of a prompt weighs more

    L = Σ_{b,k} w_b · m_bk · BCE(z_bk + V(x_b), r_b) / N        (z: the value model's logits)

The paper's Eq. 15 also has a margin m (its offline loss, Eq. 9); CASPO's value loss has none (m = 0).
μ ∈ {0, 1} makes V(x) infinite: it is clamped to [ε, 1 − ε] (ε = 1e-6, as in the paper's released code);
with DLW such a prompt's samples weigh 0 anyway (w = 1 − 1 or 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6


def group_means(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """μ of each sample's prompt group, [B]: the mean reward of the samples sharing its group id."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64, device=rewards.device)
    sums.index_add_(0, index, rewards.double())
    return (sums / counts.to(sums))[index].to(torch.float32)


def difficulty_boundary(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """ADB's shift V(x) = logit(clamp(μ(x), ε, 1 − ε)) of each sample, [B]."""
    mu = group_means(rewards, group_ids).clamp(eps, 1 - eps)
    return torch.log(mu / (1 - mu))


def outcome_weights(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DLW's weight of each sample, [B]: 1 − μ(x) when correct (r > 1/2), μ(x) when wrong."""
    mu = group_means(rewards, group_ids)
    return torch.where(rewards > 0.5, 1 - mu, mu)


def balanced_value_bce(logits: torch.Tensor, rewards: torch.Tensor, shift: torch.Tensor,
                       weight: torch.Tensor) -> torch.Tensor:
    """w_b · BCE(z_bk + V_b, r_b) elementwise, [B, K]: `logits` z [B, K], `rewards` r [B], `shift` V [B]
    (0 without ADB), `weight` w [B] (1 without DLW). Masking and the mean are the caller's."""
    target = rewards.to(logits.dtype)[:, None].expand_as(logits)
    bce = F.binary_cross_entropy_with_logits(logits + shift.to(logits)[:, None], target, reduction="none")
    return weight.to(logits)[:, None] * bce
