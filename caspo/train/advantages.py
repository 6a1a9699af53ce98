"""From rewards (and critic values) to per-token advantages, as the method row says.

    group     A_i = (s_i − mean_g) / (std_g + ε)            broadcast to the tokens of i
    terminal  s_i standardised over the batch, the group, or not at all
    gae       Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γV_{t+1} − V_t;  returns R_t = Â_t + V_t

Token rewards carry the verifier's score on the last response token, minus
β·k1(π_old, π_ref) on every token when the KL is folded into the reward; a sequence
score is their sum. Whitening (over all valid tokens) and clipping follow.
"""

from __future__ import annotations

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.methods import Method


def token_rewards(batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    mask = batch.response_mask
    last = (batch.response_lengths - 1).clamp(min=0)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(batch.size), last] = batch.rewards.to(mask.dtype) * (batch.response_lengths > 0)
    if cfg.method.kl_reward_coef > 0:
        k1 = algo.kl(batch.old_logprobs, batch.ref_logprobs, "k1")
        rewards = rewards - cfg.method.kl_reward_coef * torch.where(mask.bool(), k1, 0.0)
    return rewards


def compute_advantages(batch: RolloutBatch, cfg: Config, method: Method) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [B, R], returns [B, R] or None) for `method`."""
    m, mask = cfg.method, batch.response_mask
    rewards = token_rewards(batch, cfg)
    returns = None
    if method.advantage == "group":
        seq = algo.group_advantages(rewards.sum(-1), batch.group_ids, std_normalize=m.std_normalize)
        adv = seq[:, None] * mask
    elif method.advantage == "terminal":
        seq = algo.terminal_advantages(rewards.sum(-1), batch.group_ids, m.terminal_scope)
        adv = seq[:, None] * mask
    elif method.advantage == "gae":
        adv, returns = algo.gae(rewards, batch.values, mask, m.gamma, m.lam)
    else:
        raise ValueError(f"method {method.name}: unknown advantage {method.advantage!r}")
    whiten = m.adv_whiten if m.adv_whiten != "auto" else ("batch" if method.advantage == "gae" else "none")
    if whiten == "batch":
        adv = algo.masked_whiten(adv, mask)
    if m.adv_clip > 0:
        sigma = 1.0 if whiten == "batch" else float(algo.masked_var(adv, mask).sqrt())
        adv = adv.clamp(-m.adv_clip * sigma, m.adv_clip * sigma)
    return adv * mask, returns
