"""From rewards (and values) to per-token advantages: the advantage functions a method row names.

Each is `fn(batch, token_rewards, m) -> (advantages [B, R], returns [B, R] or None)`:

    group_relative  A_i = (s_i − mean_g) / (std_g + ε)            broadcast to the tokens of i
    terminal        s_i standardised over the batch, the group, or not at all
    gae             Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γV_{t+1} − V_t;  returns R_t = Â_t + V_t
    mc_step_td      A_k = r_k + γ·V(s_{k+1}) − V(s_k) on Monte Carlo step values (VinePPO);
                    r_k = R on the last step, V(s_n) = 0; each token takes its step's advantage
    prefix_step_td  the same on CASPO's transformed values T(V(s_k)), then whitened over all valid
                    steps (each step once) and clipped at ±method.caspo.step_adv_clip

Token rewards carry the verifier's score on the last response token, minus
β·k1(π_old, π_ref) on every token when the KL is folded into the reward; a sequence
score is their sum. Token whitening (the row's rule, or method.adv_whiten) and
clipping follow, in `compute_advantages`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config, MethodConfig

if TYPE_CHECKING:
    from caspo.methods import Method

Advantages = tuple[torch.Tensor, Optional[torch.Tensor]]


def token_rewards(batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    mask = batch.response_mask
    last = (batch.response_lengths - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(batch.size), last] = batch.rewards.to(mask.dtype) * (batch.response_lengths > 0)
    if cfg.method.kl_reward_coef > 0:
        k1 = algo.kl(batch.old_logprobs, batch.ref_logprobs, "k1")
        rewards = rewards - cfg.method.kl_reward_coef * torch.where(mask.bool(), k1, 0.0)
    return rewards


def compute_advantages(batch: RolloutBatch, cfg: Config, method: "Method") -> Advantages:
    """(advantages [B, R], returns [B, R] or None): the row's advantage function, then token whitening
    (method.adv_whiten, or the row's rule when "auto") and the ±adv_clip clip."""
    m, mask = cfg.method, batch.response_mask
    adv, returns = method.advantages(batch, token_rewards(batch, cfg), m)
    whiten = method.whiten if m.adv_whiten == "auto" else m.adv_whiten
    if whiten == "batch":
        adv = algo.masked_whiten(adv, mask)
    if m.adv_clip > 0:
        sigma = 1.0 if whiten == "batch" else float(algo.masked_var(adv, mask).sqrt())
        adv = adv.clamp(-m.adv_clip * sigma, m.adv_clip * sigma)
    return adv * mask, returns


def group_relative(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    seq = algo.group_advantages(rewards.sum(-1), batch.group_ids, std_normalize=m.std_normalize)
    return seq[:, None] * batch.response_mask, None


def terminal(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    seq = algo.terminal_advantages(rewards.sum(-1), batch.group_ids, m.terminal_scope)
    return seq[:, None] * batch.response_mask, None


def gae(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    return algo.gae(rewards, batch.values, batch.response_mask, m.gamma, m.lam)


def step_td_advantages(batch: RolloutBatch, scores: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, S] A_k = r_k + γ·V(s_{k+1}) − V(s_k) on `batch.step_values`, the score R as the last step's reward."""
    values, step_mask = batch.step_values, batch.step_mask
    n = step_mask.sum(-1).long()
    step_rewards = torch.zeros_like(values)
    step_rewards[torch.arange(len(n)), (n - 1).clamp(min=0)] = scores.to(values.dtype) * (n > 0)
    return algo.step_td(step_rewards, values, step_mask, gamma)


def to_tokens(batch: RolloutBatch, step_adv: torch.Tensor) -> torch.Tensor:
    """[B, R]: every response token takes its step's advantage (0 on padding)."""
    step_ids = batch.step_ids
    token_adv = step_adv.gather(1, step_ids.clamp(min=0))
    return torch.where(step_ids >= 0, token_adv, torch.zeros_like(token_adv)) * batch.response_mask


def mc_step_td(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    batch.step_advantages = step_td_advantages(batch, rewards.sum(-1), m.gamma)
    return to_tokens(batch, batch.step_advantages), None


def prefix_step_td(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    step_adv = algo.masked_whiten(step_td_advantages(batch, rewards.sum(-1), m.gamma), batch.step_mask)
    clip = m.caspo.step_adv_clip
    batch.step_advantages = step_adv.clamp(-clip, clip) if clip > 0 else step_adv
    return to_tokens(batch, batch.step_advantages), None
