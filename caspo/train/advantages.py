"""From rewards (and critic values) to per-token advantages, as the method row says.

    group     A_i = (s_i − mean_g) / (std_g + ε)            broadcast to the tokens of i
    terminal  s_i standardised over the batch, the group, or not at all
    gae       Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γV_{t+1} − V_t;  returns R_t = Â_t + V_t
    step_td   A_k = r_k + γ·T(V(s_{k+1})) − T(V(s_k)), r_k = R on the last step, T(V(s_n)) = 0;
              each token takes its step's advantage. CASPO's T is its value transform, and its
              step advantages are whitened over all valid steps (each step once) and clipped

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
    elif method.advantage == "step_td":
        adv = step_advantages(batch, rewards.sum(-1), cfg, method)
    else:
        raise ValueError(f"method {method.name}: unknown advantage {method.advantage!r}")
    # auto: GAE and VinePPO whiten over tokens; GRPO does not; CASPO whitened its steps already
    token_whiten = method.advantage == "gae" or method.step_values == "mc"
    whiten = m.adv_whiten if m.adv_whiten != "auto" else ("batch" if token_whiten else "none")
    if whiten == "batch":
        adv = algo.masked_whiten(adv, mask)
    if m.adv_clip > 0:
        sigma = 1.0 if whiten == "batch" else float(algo.masked_var(adv, mask).sqrt())
        adv = adv.clamp(-m.adv_clip * sigma, m.adv_clip * sigma)
    return adv * mask, returns


def step_advantages(batch: RolloutBatch, scores: torch.Tensor, cfg: Config, method: Method) -> torch.Tensor:
    from caspo.models.prefix_value import transform_values

    values, step_mask, step_ids = (batch.extras[k] for k in ("step_values", "step_mask", "step_ids"))
    caspo = method.step_values == "prefix"
    if caspo:
        values = transform_values(values, cfg.method.caspo.transform, batch.extras["beta"])
    n = step_mask.sum(-1).long()
    step_rewards = torch.zeros_like(values)
    step_rewards[torch.arange(len(n)), (n - 1).clamp(min=0)] = scores.to(values.dtype) * (n > 0)
    step_adv = algo.step_td(step_rewards, values, step_mask, cfg.method.gamma)
    if caspo:
        step_adv = algo.masked_whiten(step_adv, step_mask)
        clip = cfg.method.caspo.adv_clip
        step_adv = step_adv.clamp(-clip, clip) if clip > 0 else step_adv
    batch.extras["step_advantages"] = step_adv
    token_adv = step_adv.gather(1, step_ids.clamp(min=0))
    return torch.where(step_ids >= 0, token_adv, torch.zeros_like(token_adv)) * batch.response_mask
