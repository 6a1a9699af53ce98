"""The work that ranks split (`caspo.train.distributed`): generation and rewards by contiguous blocks of
requests (`RankSplitEngine`, `RankSplitPool`: the outer step's by whole prompts, the evaluations' by request),
and the outer step's no-grad log-probs by contiguous row blocks; every rank then holds all of it. In a single
process each is the plain call."""

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


def own_rows(n: int, group: int = 1) -> slice:
    """This rank's contiguous block of n rows that come in groups of `group` (a prompt's G samples stay together)."""
    share = distributed.block(n // group)
    return slice(share.start * group, share.stop * group)


def gathered_result(mine: RewardResult) -> RewardResult:
    """Every rank's result on its block, concatenated in rank order (the counters summed, the maxima taken)."""
    parts = distributed.gather_objects(mine)
    return RewardResult(rewards=[r for part in parts for r in part.rewards],
                        timeouts=sum(p.timeouts for p in parts), crashes=sum(p.crashes for p in parts),
                        verifier_timeouts=sum(p.verifier_timeouts for p in parts),
                        over_budget=sum(p.over_budget for p in parts), recycled=sum(p.recycled for p in parts),
                        max_call_s=max(p.max_call_s for p in parts), max_rss_mb=max(p.max_rss_mb for p in parts))


class RankSplitEngine:
    """An engine whose every call is split by ranks: each rank generates its contiguous block of the requests
    (whole groups of `group`), and every rank receives all the completions, in order. Every rank must make the
    same calls (each gathers). In a single process it is the engine's own call."""

    def __init__(self, engine: Engine, group: int = 1):
        self.engine, self.group = engine, group

    def generate(self, requests: list[Request], sampling: SamplingParams) -> list[Completion]:
        if not distributed.active():
            return self.engine.generate(requests, sampling)
        rows = own_rows(len(requests), self.group)
        mine = requests[rows]
        done = self.engine.generate(mine, sampling) if mine else []
        return [c for part in distributed.gather_objects(done) for c in part]


class RankSplitPool:
    """A reward pool whose every call is split by ranks as `RankSplitEngine` splits generation: each rank scores
    its block of the responses (the ones it generated), and every rank receives the whole result."""

    def __init__(self, pool: RewardPool, group: int = 1):
        self.pool, self.group = pool, group

    def score(self, texts: list[str], labels: list[str], finished: list[bool]) -> RewardResult:
        if not distributed.active():
            return self.pool.score(texts, labels, finished)
        rows = own_rows(len(texts), self.group)
        return gathered_result(self.pool.score(texts[rows], labels[rows], finished[rows]) if texts[rows]
                               else RewardResult([]))


def evaluation_engine_and_pool(tr: "Trainer") -> tuple[RankSplitEngine, RankSplitPool]:
    """The engine and the pool the run's evaluations call: each rank takes its block of every call's requests."""
    return RankSplitEngine(tr.engine), RankSplitPool(tr.pool)


def logprobs(model: torch.nn.Module, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """Response log-probs under `model`, no grad; with several ranks each scores its block of rows."""
    if distributed.active():
        return fsdp.score_rows(model, batch, cfg, response_logprobs, cfg.rollout.temperature)
    return score(model, batch, cfg)
