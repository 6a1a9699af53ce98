"""The rollout setup of a preset, as the trainer samples: policy, engine, sampler, decode, verifier.

Phase-1 labels and MC checks must estimate the success rate of exactly the sampler
the trainer uses, so they build it from the same config fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from caspo.config import Config
from caspo.models.policy import load_policy, resolve_device, resolve_model_path
from caspo.models.tokenizer import load_tokenizer
from caspo.reward.pool import RewardPool, TallyingScorer
from caspo.rollout.base import SamplingParams
from caspo.rollout.factory import build_engine, max_seq_len, sampling_params


@dataclass
class RolloutSetup:
    tokenizer: object
    policy: torch.nn.Module
    engine: object  # an Engine (caspo.rollout.base), as rollout.backend says
    sampling: SamplingParams
    decode: Callable[[list[int]], str]  # response text as the verifier reads it

    def scorer(self, pool: RewardPool) -> TallyingScorer:
        """The rewards of a batch, with the calls left without a verdict summed in its `unscored`."""
        return TallyingScorer(pool)


def rollout_setup(cfg: Config) -> RolloutSetup:
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    path = resolve_model_path(cfg.model.policy, cfg.model.revision)
    tokenizer = load_tokenizer(path)
    policy = load_policy(path, resolve_device(cfg.model.device)).eval()
    engine = build_engine(cfg, policy, tokenizer, max_seq_len(cfg))
    return RolloutSetup(tokenizer, policy, engine, sampling_params(cfg, tokenizer, policy),
                        partial(tokenizer.decode, skip_special_tokens=True))
