"""Statistics over the prompt groups of a batch (G samples of each prompt)."""

from __future__ import annotations

import torch


def group_pass_rate(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """pass@G of a batch: the share of groups with at least one correct sample,

        pass@G = (1/|groups|) Σ_g 1[max_{i ∈ g} r_i > 0]

    `rewards` [B] (a sample is correct when its reward is positive), `group_ids` [B]; 0 for no samples.
    """
    if rewards.numel() == 0:
        return 0.0
    groups, index = torch.unique(group_ids, return_inverse=True)
    solved = torch.zeros(len(groups), device=rewards.device)
    solved.scatter_reduce_(0, index, (rewards > 0).float(), reduce="amax")
    return float(solved.mean())
