"""Method-owned state and the hooks the outer step calls on it, in this order:

    values(tr, batch)            t_value         the batch's values: critic, Monte Carlo or prefix model
    (the row's advantage function)
    after_advantages(tr, batch)  t_value_update  e.g. CASPO's online value-model step
    before_update(tr)            t_pol           e.g. flow_dppo freezes the old policy
    (the update: the policy, then every learner in `learners`, minibatch by minibatch)

A method without state (grpo, ppo, dppo_tv, ...) uses `MethodState` itself. State that
is trained is a `Learner` in `learners`, saved and restored with the run beside the policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.train.optim import Learner

if TYPE_CHECKING:
    from caspo.train.trainer import Trainer

# (model, micro-batch, cfg, denom: the minibatch's algo.Counts) -> (loss, metrics): the loss of a learner trained
# beside the policy
LearnerLoss = Callable[..., tuple[torch.Tensor, dict]]


class MethodState:
    """No state: every hook does nothing."""

    learners: dict[str, Learner]  # name -> learner: trained beside the policy and saved in <checkpoint>/<name>/

    def __init__(self):
        self.learners = {}

    @classmethod
    def build(cls, cfg: Config, policy_path: str, policy: torch.nn.Module, tokenizer,
              device: torch.device) -> "MethodState":
        """The state of a new run: `policy` is the loaded base policy, `policy_path` its folder."""
        return cls()

    def values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        return {}

    def after_advantages(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        return {}

    def before_update(self, tr: "Trainer") -> None:
        pass

    def learner_losses(self) -> dict[str, LearnerLoss]:
        """The update's loss for each learner of `learners` it trains with the policy, in that order."""
        return {}

    def shard(self, precision: str) -> None:
        """With several processes: shard the models it owns (its learners, each optimizer built again after
        wrapping, and frozen models, called through `caspo.train.fsdp.call`)."""

    def frozen_old_policy(self) -> torch.nn.Module:
        """The policy as it was before this update, for a loss that reads its full-vocabulary distributions."""
        raise TypeError(f"{type(self).__name__} keeps no frozen old policy, so it cannot serve a loss that reads "
                        "the old policy's full-vocabulary distributions")

    def state_dict(self) -> dict:
        """What a checkpoint's trainer state records beyond the learners."""
        return {}

    def export_files(self) -> dict[str, dict[str, str]]:
        """Files beside a learner's exported model (learner name -> file name -> text), so that the folder
        loads on its own as what it is."""
        return {}

    def load_state_dict(self, tr: "Trainer", state: dict) -> None:
        pass
