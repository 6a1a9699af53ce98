"""Advantages, KL estimators, losses and masked statistics as pure tensor functions."""

from caspo.algo.advantages import TERMINAL_SCOPES, gae, group_advantages, step_td, terminal_advantages
from caspo.algo.head_logprobs import head_categorical_kl, head_token_logprobs, head_token_loss
from caspo.algo.kl import KL_KINDS, kl
from caspo.algo.logprobs import token_entropy, token_logprobs
from caspo.algo.losses import (
    decoupled_ppo_loss,
    divergence_gate_loss,
    dppo_binary_loss,
    ppo_clip_loss,
    value_loss,
)
from caspo.algo.stats import (
    AGG_MODES,
    Counts,
    aggregate,
    aggregate_denom,
    masked_fill_zero,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "AGG_MODES",
    "Counts",
    "KL_KINDS",
    "TERMINAL_SCOPES",
    "aggregate",
    "aggregate_denom",
    "decoupled_ppo_loss",
    "divergence_gate_loss",
    "dppo_binary_loss",
    "gae",
    "group_advantages",
    "head_categorical_kl",
    "head_token_logprobs",
    "head_token_loss",
    "kl",
    "masked_fill_zero",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_loss",
    "step_td",
    "terminal_advantages",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
