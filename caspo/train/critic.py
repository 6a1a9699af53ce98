"""The critic of GAE methods (ppo_critic, dppo) and flow_dppo's frozen old policy beside it."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.critic import critic_values, load_critic
from caspo.models.policy import compile_if_asked, recompute_if_asked
from caspo.train import distributed, fsdp
from caspo.train.advantages import token_rewards
from caspo.train.method_state import LearnerLoss, MethodState
from caspo.train.optim import learner
from caspo.train.scoring import no_grad_pass
from caspo.train.update import UpdateStats, has_dropout, loss_norm_len, sleep_engine, train_minibatch

if TYPE_CHECKING:
    from caspo.methods import Method
    from caspo.train.trainer import Trainer


def critic_loss(critic: torch.nn.Module, batch: RolloutBatch, cfg: Config, denom) -> tuple[torch.Tensor, dict]:
    """Clipped value loss against the GAE returns, around the values read before the update."""
    return clipped_value_loss(critic_values(critic, batch), batch, cfg, denom)


def clipped_value_loss(values: torch.Tensor, batch: RolloutBatch, cfg: Config, denom) -> tuple[torch.Tensor, dict]:
    loss, metrics = algo.value_loss(values, batch.values, batch.returns, batch.response_mask,
                                    clip=cfg.method.value_clip, agg=cfg.method.loss_agg, denom=denom)
    return loss, dict(metrics, vf_loss=loss.detach())


def loss_on_own_values(method: "Method", returns_known: bool) -> LearnerLoss:
    """`critic_loss` whose values before the update are this forward's, detached. Unless `returns_known`
    (already in the batch), the returns are the method's advantage function on them, micro-batch by
    micro-batch: the function must be row by row (GAE is), and gives what `compute_advantages` later
    gives for these rows."""
    def loss(critic, micro: RolloutBatch, cfg: Config, denom):
        values = critic_values(critic, micro)
        micro.values = values.detach()
        if not returns_known:
            micro.returns = method.advantages(micro, token_rewards(micro, cfg), cfg.method)[1]
        return clipped_value_loss(values, micro, cfg, denom)
    return loss


def values_are_current(cfg: Config, critic: torch.nn.Module) -> bool:
    """Whether the values pass would recompute what the critic update's own first forward gives.

    That holds when the critic takes one optimizer step per rollout, on the whole batch (μ = 1, one
    minibatch), in a forward without dropout. The values then come from that step, taken in the
    value phase, before the advantages it feeds. train.critic_values=recompute keeps the pass.
    """
    t = cfg.train
    return (t.critic_values == "auto" and t.epochs_per_rollout == 1 and t.minibatch_size >= cfg.responses_per_step
            and not has_dropout(critic))


class Critic(MethodState):
    """A scalar critic (the policy's backbone + a zero-initialised head), trained beside the policy with
    its own settings of optim.name's optimizer (method.critic_lr, critic_weight_decay, critic_grad_clip; the schedule
    is optim's)."""

    def __init__(self, cfg: Config, policy_path: str, device: torch.device):
        super().__init__()
        model = load_critic(policy_path, device).eval()
        recompute_if_asked(cfg.train, model)
        compile_if_asked(cfg.train, model)
        m = cfg.method
        self.learners = {"critic": learner(model, cfg, lr=m.critic_lr, weight_decay=m.critic_weight_decay,
                                           grad_clip=m.critic_grad_clip)}
        self.trains_in_value_phase = values_are_current(cfg, model)

    @classmethod
    def build(cls, cfg: Config, policy_path: str, policy: torch.nn.Module, tokenizer, device: torch.device):
        return cls(cfg, policy_path, device)

    def values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        if not self.trains_in_value_phase:  # with several processes each rank scores its block of rows
            model = self.learners["critic"].model
            batch.values = (fsdp.score_rows(model, batch, tr.cfg, critic_values) if distributed.active()
                            else no_grad_pass(model, batch, tr.cfg, critic_values))
            return {}
        return self.train_on_own_values(tr, batch)

    def train_on_own_values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        """The critic's one step of this rollout, whose first forward gives `batch.values`: the same step
        as in the update, without a second forward of the batch before it."""
        critic, stats, cfg = self.learners["critic"], UpdateStats(), tr.cfg
        sleep_engine(tr)
        batch.values = torch.zeros_like(batch.behaviour_logprobs)
        # GAE's returns at λ = 1 are the discounted rewards-to-go whatever the values (the V terms telescope):
        # one pass over the batch with V = 0, not a scan over the tokens of every micro-batch
        returns_known = cfg.method.lam == 1.0
        if returns_known:
            batch.returns = tr.method.advantages(batch, token_rewards(batch, cfg), cfg.method)[1]
        rows = torch.arange(batch.size)
        critic.model.train()
        train_minibatch("critic_grad_norm", critic, batch, rows, cfg, tr.scaler, loss_norm_len(cfg),
                        loss_on_own_values(tr.method, returns_known), stats, written=("values",))
        critic.model.eval()
        stats.minibatches = 1
        batch.values = distributed.share_rows(batch.values, torch.isin(rows, distributed.my_rows(rows)))
        return stats.result()

    def learner_losses(self) -> dict[str, LearnerLoss]:
        return {} if self.trains_in_value_phase else {"critic": critic_loss}

    def shard(self, precision: str) -> None:
        """The critic sharded (its optimizer built again), wherever it trains: in the update, or in the value
        phase; FSDP sums the ranks' gradients of their rows."""
        lr = self.learners["critic"]
        self.learners["critic"] = fsdp.rebuild(lr, fsdp.shard_called(lr.model, precision))


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

    def shard(self, precision: str) -> None:
        super().shard(precision)
        fsdp.shard_routed(self.old_policy, precision)  # as the policy: each rank copies its own shards into it

    def frozen_old_policy(self) -> torch.nn.Module:
        return self.old_policy
