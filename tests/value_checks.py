"""CASPO's prefix-value state on the tests preset, and a batch of 3-step responses, for the value tests."""

import torch

from caspo.config import load_config
from caspo.methods import resolve_method


def online_values(value_model_folder, *overrides):
    from caspo.models.policy import load_policy
    from caspo.models.tokenizer import load_tokenizer
    from caspo.train.step_values import PrefixValues, ValueSource

    cfg = load_config("tests", ["method.name=caspo", f"method.caspo.value_model={value_model_folder}",
                                "method.caspo.online=true", "method.caspo.online_value_lr=1e-3", *overrides])
    resolve_method(cfg)
    tokenizer = load_tokenizer(value_model_folder)
    return PrefixValues(cfg, tokenizer, ValueSource(str(value_model_folder), cfg.model.policy),
                        load_policy(cfg.model.policy), "cpu")


def batch_of(rewards, groups):
    """Eight responses of 3 steps (4, 3 and 2 tokens) each: boundaries k = 1, 2 in every row."""
    from caspo.batch import RolloutBatch
    from caspo.rollout.base import Completion

    tokens = [[10 + i, 20, 21, 30, 31, 32, 40, 41, 5 + i] for i in range(len(rewards))]
    batch = RolloutBatch.from_completions(
        [[2, 11, 12]] * len(rewards), [Completion(t, [0.0] * len(t), "stop", 0) for t in tokens],
        group_ids=groups.tolist(), example_ids=[str(g) for g in groups.tolist()],
        sample_seeds=list(range(len(rewards))), texts=[""] * len(rewards), pad_token_id=0)
    batch.rewards = rewards.clone()
    batch.step_ids = torch.tensor([[0] * 4 + [1] * 3 + [2] * 2] * len(rewards))
    return batch
