"""Greedy held-out accuracy: one greedy completion per problem, scored by the verifier."""

from __future__ import annotations

from dataclasses import dataclass

from caspo.reward.pool import RewardPool
from caspo.rollout.base import Request, SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    boxed_rate: float  # fraction of completions containing a \boxed{}
    truncated_rate: float
    n: int
    texts: list[str]
    rewards: list[float]

    def summary(self) -> dict:
        return {"accuracy": self.accuracy, "boxed_rate": self.boxed_rate,
                "truncated_rate": self.truncated_rate, "n": self.n}


def greedy_accuracy(engine, tokenizer, prompt_ids: list[list[int]], labels: list[str], pool: RewardPool,
                    *, max_new_tokens: int, stop_token_ids: list[int], stop_strings: list[str] = ()) -> EvalResult:
    requests = [Request(p, seed=0, max_new_tokens=max_new_tokens) for p in prompt_ids]
    sampling = SamplingParams(temperature=0.0, stop_token_ids=stop_token_ids, stop_strings=list(stop_strings))
    completions = engine.generate(requests, sampling)
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
    finished = [c.finish_reason == "stop" for c in completions]
    rewards = pool.score(texts, labels, finished).rewards
    n = len(texts)
    return EvalResult(
        accuracy=sum(rewards) / n,
        boxed_rate=sum("\\boxed{" in t for t in texts) / n,
        truncated_rate=sum(not f for f in finished) / n,
        n=n,
        texts=texts,
        rewards=rewards,
    )
