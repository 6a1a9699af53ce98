"""The policy losses a method row can name, as functions of one micro-batch's tensors.

Each takes `LossInputs` and the `method` config section and returns (loss, metrics),
calling one pure loss of `caspo.algo`:

    ppo_clip         clipped surrogate on r = π/π_old (π_old recomputed by the trainer)
    decoupled        clipped surrogate on r = π/π_prox, weighted by clamp(π_prox/μ), μ the engine's scores
    dppo_tv/_kl      Divergence-PPO's binary trust-region mask (total variation / KL)
    divergence_gate  full-vocabulary KL(old‖new) gate against the frozen old policy's distributions
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import MethodConfig


@dataclass
class LossInputs:
    logp: torch.Tensor  # [b, R] log-probs of the sampled tokens under the policy being trained (with grad)
    batch: RolloutBatch  # the micro-batch: old / behaviour log-probs, advantages, mask
    denom: Optional[algo.Counts]  # the whole minibatch's counts: each term's normaliser follows from them
    # losses that read the vocabulary: the frozen old policy's log-probs and KL(old ‖ current), no grad
    frozen_old_logp: Optional[torch.Tensor] = None  # [b, R]
    divergence: Optional[torch.Tensor] = None  # [b, R]


@dataclass(frozen=True)
class PolicyLoss:
    """A loss and what it reads: the sampled tokens' log-probs, or the whole vocabulary's.

    token_separable: the loss's gradient at a token reads that token's log-prob alone (per-token terms,
    summed with weights fixed beforehand), so the update may take it chunk by chunk in the head's forward
    (`caspo.algo.head_token_loss`) instead of recomputing the logits in the backward. Each loss here is;
    a new one (a sequence-level ratio, say) leaves it False. tests/test_head_gradient_in_forward.py checks
    the gradient of every registered method's token-separable loss both ways.
    """

    fn: Callable[[LossInputs, MethodConfig], tuple[torch.Tensor, dict]]
    full_vocab: bool = False
    token_separable: bool = False


def _clip(m: MethodConfig) -> dict:
    return dict(clip_low=m.clip_low, clip_high=m.clip_high, dual_clip=m.dual_clip)


def ppo_clip(x: LossInputs, m: MethodConfig):
    b = x.batch
    return algo.ppo_clip_loss(x.logp, b.old_logprobs, b.advantages, b.response_mask, **_clip(m),
                              agg=m.loss_agg, denom=x.denom)


def decoupled(x: LossInputs, m: MethodConfig):
    b = x.batch
    return algo.decoupled_ppo_loss(x.logp, b.old_logprobs, b.behaviour_logprobs, b.advantages, b.response_mask,
                                   weight_bounds=(m.iw_low, m.iw_high), **_clip(m), agg=m.loss_agg, denom=x.denom)


def dppo_binary(divergence: str):
    def loss(x: LossInputs, m: MethodConfig):
        b = x.batch
        return algo.dppo_binary_loss(x.logp, b.old_logprobs, b.advantages, b.response_mask, divergence=divergence,
                                     delta_low=m.dppo_delta_low, delta_high=m.dppo_delta_high,
                                     ratio_cap=m.dppo_ratio_cap, agg=m.loss_agg, denom=x.denom)
    loss.__name__ = f"dppo_binary_{divergence}"
    return loss


def divergence_gate(x: LossInputs, m: MethodConfig):
    b = x.batch
    return algo.divergence_gate_loss(x.logp, x.frozen_old_logp, x.divergence, b.advantages, b.response_mask,
                                     threshold=m.gate_threshold, agg=m.loss_agg, denom=x.denom)


PPO_CLIP = PolicyLoss(ppo_clip, token_separable=True)
DECOUPLED = PolicyLoss(decoupled, token_separable=True)
DPPO_TV = PolicyLoss(dppo_binary("tv"), token_separable=True)
DPPO_KL = PolicyLoss(dppo_binary("kl"), token_separable=True)
DIVERGENCE_GATE = PolicyLoss(divergence_gate, full_vocab=True, token_separable=True)
