"""From rewards (and values) to per-token advantages: the advantage functions a method row names.

Each is `fn(batch, token_rewards, m) -> (advantages [B, R], returns [B, R] or None)`:

    group_relative  A_i = (s_i − mean_g) / (std_g + ε)            broadcast to the tokens of i
    terminal        s_i standardised over the batch, the group, or not at all
    gae             Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γV_{t+1} − V_t;  returns R_t = Â_t + V_t
    mc_step_td      A_k = r_k + γ·V(s_{k+1}) − V(s_k) on Monte Carlo step values (VinePPO);
                    r_k the rewards of step k's tokens (R in the last step), V(s_n) = 0; each token
                    takes its step's advantage
    prefix_step_td  the same on CASPO's transformed values T(V(s_k)), then whitened over the valid
                    steps (each step once) of method.step_adv_scope and clipped at ±method.caspo.step_adv_clip σ

Token rewards carry the verifier's score on the last response token, minus
β·k1(π_old, π_ref) on every token when the KL is folded into the reward; a sequence
score is their sum. Token whitening and the ±method.adv_clip σ clip follow, in
`compute_advantages`: over method.step_adv_scope for a row whose step advantages are
whitened per token (vineppo), else by method.adv_whiten (or the row's rule when "auto").
The clip's σ is 1 for advantages already in σ units: whitened ones, caspo's whitened steps, and
scores divided by their group's (or batch's) std (grpo, dppo_tv/_kl, ppo's terminal scopes), whose
pooled std is below 1 wherever a group's samples all score alike. Otherwise (Dr. GRPO's centred
scores, ppo's raw ones) σ is the batch's masked std. A
scope of "minibatch" (step_adv_scope or adv_whiten) leaves both to the update, each optimizer minibatch
taking `minibatch_advantages` of its rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from caspo import algo
from caspo.algo.advantages import batch_whiten, scoped_whiten
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
    over `token_scope` and the ±adv_clip σ clip."""
    m, mask = cfg.method, batch.response_mask
    adv, returns = method.advantages(batch, token_rewards(batch, cfg), m)
    scope = token_scope(method, m)
    if scope == "minibatch":  # whitened and clipped in the update, minibatch by minibatch (minibatch_advantages)
        return adv * mask, returns
    adv = scoped_whiten(adv, mask, batch.group_ids, scope) if scope != "off" else adv
    # caspo's step advantages come whitened over their steps: ±adv_clip is then in those units
    whitened = (scope != "off" or (method.step_whiten == "steps" and m.step_adv_scope != "off")
                or standardised_scores(method, m))
    adv = clip_sigmas(adv, mask, m.adv_clip, whitened=whitened)
    return adv * mask, returns


def token_scope(method: "Method", m: MethodConfig) -> str:
    """What token advantages are whitened over: "batch", "group", "minibatch" (in the update) or "off".

    method.step_adv_scope for a row whose step advantages are whitened per token (vineppo);
    otherwise method.adv_whiten (the row's rule when "auto"), "off" for "none"."""
    if method.step_whiten == "tokens":
        return m.step_adv_scope
    whiten = method.whiten if m.adv_whiten == "auto" else m.adv_whiten
    return "off" if whiten == "none" else whiten


def standardised_scores(method: "Method", m: MethodConfig) -> bool:
    """Whether the row's sequence scores are divided by their std: group-relative ones (grpo, dppo_tv, dppo_kl)
    and ppo's batch- or group-standardised terminal ones, unless method.std_normalize=false."""
    return m.std_normalize and (method.group_baseline or (method.advantages is terminal and m.terminal_scope != "off"))


def minibatch_advantages(advantages: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, k: float) -> torch.Tensor:
    """`advantages` [B, R] with the rows of one optimizer minibatch whitened over their valid tokens and clipped at
    ±k σ (method.step_adv_scope=minibatch): upstream VinePPO's trainer whitens the advantages of the episodes each
    training step reads (64, across its GPUs), every epoch anew, for VinePPO and for its PPO baseline
    (method.adv_whiten=minibatch). The other rows are left as they are."""
    out = advantages.clone()
    out[rows] = clip_sigmas(batch_whiten(advantages[rows], mask[rows]), mask[rows], k, whitened=True)
    return out


def clip_sigmas(adv: torch.Tensor, mask: torch.Tensor, k: float, whitened: bool) -> torch.Tensor:
    """adv clamped at ±k·σ (k = 0, or fewer than two entries: unchanged); σ = 1 for whitened advantages (each
    scope has unit variance), else the masked std of `adv`."""
    if k <= 0 or (not whitened and int(mask.bool().sum()) < 2):
        return adv
    sigma = 1.0 if whitened else float(algo.masked_var(adv, mask).sqrt())
    return adv.clamp(-k * sigma, k * sigma)


def group_relative(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    seq = algo.group_advantages(rewards.sum(-1), batch.group_ids, std_normalize=m.std_normalize)
    return seq[:, None] * batch.response_mask, None


def terminal(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    seq = algo.terminal_advantages(rewards.sum(-1), batch.group_ids, m.terminal_scope, std_normalize=m.std_normalize)
    return seq[:, None] * batch.response_mask, None


def gae(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    return algo.gae(rewards, batch.values, batch.response_mask, m.gamma, m.lam)


def step_td_advantages(batch: RolloutBatch, rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, S] A_k = r_k + γ·V(s_{k+1}) − V(s_k) on `batch.step_values`, r_k the token rewards [B, R] of step k
    summed: the score R sits on the last response token, so in the last step, and a KL penalty folded into the
    reward is charged to the step whose token paid it."""
    values, step_ids = batch.step_values, batch.step_ids
    paid = torch.where(step_ids >= 0, rewards.to(values.dtype), torch.zeros((), dtype=values.dtype))
    step_rewards = torch.zeros_like(values).scatter_add_(1, step_ids.clamp(min=0), paid)
    return algo.step_td(step_rewards, values, batch.step_mask, gamma)


def to_tokens(batch: RolloutBatch, step_adv: torch.Tensor) -> torch.Tensor:
    """[B, R]: every response token takes its step's advantage (0 on padding)."""
    step_ids = batch.step_ids
    token_adv = step_adv.gather(1, step_ids.clamp(min=0))
    return torch.where(step_ids >= 0, token_adv, torch.zeros_like(token_adv)) * batch.response_mask


def mc_step_td(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    batch.step_advantages = step_td_advantages(batch, rewards, m.gamma)
    return to_tokens(batch, batch.step_advantages), None


def prefix_step_td(batch: RolloutBatch, rewards: torch.Tensor, m: MethodConfig) -> Advantages:
    step_adv = step_td_advantages(batch, rewards, m.gamma)
    scope = m.step_adv_scope
    if scope != "off":
        step_adv = scoped_whiten(step_adv, batch.step_mask, batch.group_ids, scope)
    batch.step_advantages = clip_sigmas(step_adv, batch.step_mask, m.caspo.step_adv_clip, whitened=scope != "off")
    return to_tokens(batch, batch.step_advantages), None
