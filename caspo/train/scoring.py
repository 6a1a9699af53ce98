"""No-grad passes over a batch, micro-batch by micro-batch: the old and reference log-probs, critic values."""

from __future__ import annotations

from typing import Callable

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.forward import response_logprobs
from caspo.precision import autocast


def score_micro_batching(cfg: Config) -> tuple[int, int]:
    """(rows, padded tokens) of a no-grad pass's micro-batches: train.score_micro_batch_size / _tokens where
    set, else the update's."""
    t = cfg.train
    return t.score_micro_batch_size or t.micro_batch_size, t.score_micro_batch_tokens or t.micro_batch_tokens


@torch.no_grad()
def no_grad_pass(model: torch.nn.Module, batch: RolloutBatch, cfg: Config,
                 fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`fn(model, micro_batch, *args)` -> [b, R] over the batch, micro-batch by micro-batch, no grad."""
    out = torch.zeros_like(batch.behaviour_logprobs)
    rows, tokens = score_micro_batching(cfg)
    for idx, micro in batch.micro_batches(rows, max_tokens=tokens):
        with autocast(cfg.train.precision, micro.input_ids.device):
            out[idx, :micro.responses.shape[1]] = fn(model, micro, *args).float()
    return out


def score(model: torch.nn.Module, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Response log-probs under `model` (temperature-scaled), no grad."""
    return no_grad_pass(model, batch, cfg, response_logprobs, cfg.rollout.temperature)
