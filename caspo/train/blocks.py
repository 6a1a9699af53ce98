"""The work that ranks split (`caspo.train.distributed`): the outer step's generation and rewards by
contiguous prompt blocks, its no-grad log-probs by contiguous row blocks, and the evaluations' requests by
contiguous blocks (`RankSplitEngine`, `RankSplitPool`); every rank then holds all of it. In a single process
each is the plain call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.forward import response_logprobs
from caspo.reward.pool import RewardPool, RewardResult
from caspo.rollout.base import Completion, Engine, Request, SamplingParams
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
    return gathered_result(mine)


def gathered_result(mine: RewardResult) -> RewardResult:
    """Every rank's result on its block, concatenated in rank order (the counters summed, the maxima taken)."""
    parts = distributed.gather_objects(mine)
    return RewardResult(rewards=[r for part in parts for r in part.rewards],
                        timeouts=sum(p.timeouts for p in parts), crashes=sum(p.crashes for p in parts),
                        over_budget=sum(p.over_budget for p in parts), recycled=sum(p.recycled for p in parts),
                        max_call_s=max(p.max_call_s for p in parts), max_rss_mb=max(p.max_rss_mb for p in parts))


class RankSplitEngine:
    """An engine for the evaluations of a run of several processes: each rank generates its contiguous block of
    every call's requests, and every rank receives all the completions, in order. Every rank must make the same
    calls (each gathers)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, requests: list[Request], sampling: SamplingParams) -> list[Completion]:
        share = distributed.block(len(requests))
        done = self.engine.generate(requests[share.start:share.stop], sampling) if share else []
        return [c for part in distributed.gather_objects(done) for c in part]


class RankSplitPool:
    """A reward pool for the evaluations of a run of several processes: each rank scores its contiguous block of
    every call's responses, and every rank receives the whole result."""

    def __init__(self, pool: RewardPool):
        self.pool = pool

    def score(self, texts: list[str], labels: list[str], finished: list[bool]) -> RewardResult:
        share = distributed.block(len(texts))
        rows = slice(share.start, share.stop)
        return gathered_result(self.pool.score(texts[rows], labels[rows], finished[rows]) if share
                               else RewardResult([]))


def evaluation_engine_and_pool(tr: "Trainer") -> tuple:
    """The engine and the pool the run's evaluations call: split by ranks when there are several."""
    if not distributed.active():
        return tr.engine, tr.pool
    return RankSplitEngine(tr.engine), RankSplitPool(tr.pool)


def logprobs(model: torch.nn.Module, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Response log-probs under `model`, no grad; with several ranks each scores its block of rows."""
    if distributed.active():
        return fsdp.score_rows(model, batch, cfg, response_logprobs, cfg.rollout.temperature)
    return score(model, batch, cfg)
