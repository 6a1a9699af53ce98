"""No-grad passes over a batch, micro-batch by micro-batch: the old and reference log-probs, critic values."""

from __future__ import annotations

from typing import Callable

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.forward import response_logprobs
from caspo.precision import autocast


@torch.no_grad()
def no_grad_pass(model: torch.nn.Module, batch: RolloutBatch, cfg: Config,
                 fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`fn(model, micro_batch, *args)` -> [b, R] over the batch, micro-batch by micro-batch, no grad."""
    out = torch.zeros_like(batch.behaviour_logprobs)
    for idx, micro in batch.micro_batches(cfg.train.micro_batch_size, max_tokens=cfg.train.micro_batch_tokens):
        with autocast(cfg.train.precision, micro.input_ids.device):
            out[idx, :micro.responses.shape[1]] = fn(model, micro, *args).float()
    return out


def score(model: torch.nn.Module, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Response log-probs under `model` (temperature-scaled), no grad."""
    return no_grad_pass(model, batch, cfg, response_logprobs, cfg.rollout.temperature)
