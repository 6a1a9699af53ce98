"""The critic of GAE methods (ppo_critic, dppo) and flow_dppo's frozen old policy beside it."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.critic import critic_values, load_critic
from caspo.models.policy import compile_if_asked, enable_recompute
from caspo.train.method_state import LearnerLoss, MethodState
from caspo.train.optim import learner
from caspo.train.scoring import no_grad_pass

if TYPE_CHECKING:
    from caspo.train.trainer import Trainer


def critic_loss(critic: torch.nn.Module, batch: RolloutBatch, cfg: Config, denom) -> tuple[torch.Tensor, dict]:
    """Clipped value loss against the GAE returns, around the values read before the update."""
    values = critic_values(critic, batch)
    loss, metrics = algo.value_loss(values, batch.values, batch.returns, batch.response_mask,
                                    clip=cfg.method.value_clip, agg=cfg.method.loss_agg, denom=denom)
    return loss, dict(metrics, vf_loss=loss.detach())


class Critic(MethodState):
    """A scalar critic (the policy's backbone + a zero-initialised head), trained beside the policy with
    its own AdamW settings (method.critic_lr, critic_weight_decay, critic_grad_clip; the schedule is optim's)."""

    def __init__(self, cfg: Config, policy_path: str, device: torch.device):
        super().__init__()
        model = load_critic(policy_path, device).eval()
        if cfg.train.activation_checkpointing:
            enable_recompute(model)
        compile_if_asked(cfg.train, model)
        m = cfg.method
        self.learners = {"critic": learner(model, cfg, lr=m.critic_lr, weight_decay=m.critic_weight_decay,
                                           grad_clip=m.critic_grad_clip)}

    @classmethod
    def build(cls, cfg: Config, policy_path: str, policy: torch.nn.Module, tokenizer, device: torch.device):
        return cls(cfg, policy_path, device)

    def values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        batch.values = no_grad_pass(self.learners["critic"].model, batch, tr.cfg, critic_values)
        return {}

    def learner_losses(self) -> dict[str, LearnerLoss]:
        return {"critic": critic_loss}


class CriticAndFrozenOld(Critic):
    """flow_dppo: the critic, and a frozen copy of the policy taken before each update, whose
    full-vocabulary distributions the divergence gate compares against."""

    def __init__(self, cfg: Config, policy_path: str, policy: torch.nn.Module, device: torch.device):
        super().__init__(cfg, policy_path, device)
        self.old_policy = copy.deepcopy(policy).requires_grad_(False)

    @classmethod
    def build(cls, cfg: Config, policy_path: str, policy: torch.nn.Module, tokenizer, device: torch.device):
        return cls(cfg, policy_path, policy, device)

    def before_update(self, tr: "Trainer") -> None:
        self.old_policy.load_state_dict(tr.policy.state_dict())

    def frozen_old_policy(self) -> torch.nn.Module:
        return self.old_policy
