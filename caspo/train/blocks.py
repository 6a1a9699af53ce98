"""The outer step's work that ranks split (`caspo.train.distributed`): generation and rewards by
contiguous prompt blocks, no-grad log-probs by contiguous row blocks; every rank then holds all of it.
In a single process each is the plain call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.forward import response_logprobs
from caspo.reward.pool import RewardResult
from caspo.rollout.base import Completion, Request
from caspo.train import distributed, fsdp
from caspo.train.scoring import score

if TYPE_CHECKING:
    from caspo.train.trainer import Trainer


def generate_blocks(tr: "Trainer", requests: list[Request], G: int) -> list[Completion]:
    """The completions of `requests` (G per prompt), in order; with several ranks, each generates its block
    of prompts and every rank receives all of them."""
    if not distributed.active():
        return tr.engine.generate(requests, tr.sampling)
    share = distributed.block(len(requests) // G)
    mine = requests[share.start * G:share.stop * G]
    done = tr.engine.generate(mine, tr.sampling) if mine else []
    return [c for part in distributed.gather_objects(done) for c in part]


def score_blocks(tr: "Trainer", batch: RolloutBatch) -> RewardResult:
    """The verifier's result on the batch; with several ranks, each scores its block of prompts' rows (the
    rows it generated) and every rank receives the whole result."""
    finished = batch.finished.tolist()
    if not distributed.active():
        return tr.pool.score(batch.texts, batch.labels, finished)
    G = tr.cfg.rollout.samples_per_prompt
    share = distributed.block(batch.size // G)
    rows = slice(share.start * G, share.stop * G)
    mine = tr.pool.score(batch.texts[rows], batch.labels[rows], finished[rows]) if share else RewardResult([])
    parts = distributed.gather_objects(mine)
    return RewardResult(rewards=[r for part in parts for r in part.rewards],
                        timeouts=sum(p.timeouts for p in parts), crashes=sum(p.crashes for p in parts),
                        over_budget=sum(p.over_budget for p in parts), recycled=sum(p.recycled for p in parts),
                        max_call_s=max(p.max_call_s for p in parts), max_rss_mb=max(p.max_rss_mb for p in parts))


def logprobs(model: torch.nn.Module, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Response log-probs under `model`, no grad; with several ranks each scores its block of rows."""
    if distributed.active():
        return fsdp.score_rows(model, batch, cfg, response_logprobs, cfg.rollout.temperature)
    return score(model, batch, cfg)
