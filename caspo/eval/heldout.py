"""Held-out accuracy: one greedy completion per problem, or the mean reward of k samples per
problem (avg@k) from the training sampler, scored by the verifier."""

from __future__ import annotations

from dataclasses import dataclass, field

from caspo.reward.extract import has_box
from caspo.reward.pool import RewardPool, Unscored
from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.sampling import sample_seed

EVAL_SEED_STEP = -(2 ** 31)  # the `step` of held-out sample seeds: never an RL or a collection step
EVAL_RUN_SEED = 0  # the same for every run, so every run is judged on the same random numbers


@dataclass
class EvalResult:
    accuracy: float
    boxed_rate: float  # fraction of completions with a box the extractor reads (\boxed{}, \fbox{}, \boxed 42)
    truncated_rate: float
    n: int
    texts: list[str]
    rewards: list[float]
    unscored: Unscored = field(default_factory=Unscored)  # completions left without a verdict (reward 0)

    def summary(self) -> dict:
        """The metrics, and the completions the verifier left without a verdict: reward_unscored and its causes
        (reward_timeouts, reward_verifier_timeouts, reward_crashes, reward_over_budget)."""
        return {"accuracy": self.accuracy, "boxed_rate": self.boxed_rate,
                "truncated_rate": self.truncated_rate, "n": self.n, **self.unscored.counts("reward_")}


def greedy_requests(prompt_ids: list[list[int]], max_new_tokens: int) -> list[Request]:
    return [Request(p, seed=0, max_new_tokens=max_new_tokens) for p in prompt_ids]


def sample_requests(prompt_ids: list[list[int]], samples: int, max_new_tokens: int, first: int = 0) -> list[Request]:
    """`samples` requests per prompt, problem-major; prompt j is problem `first + j` of its set, and
    sample s of problem i always has the seed (EVAL_RUN_SEED, EVAL_SEED_STEP, i, s)."""
    if samples < 1:
        raise ValueError(f"samples per held-out problem must be >= 1, got {samples}")
    return [Request(p, seed=sample_seed(EVAL_RUN_SEED, EVAL_SEED_STEP, first + j, s), max_new_tokens=max_new_tokens)
            for j, p in enumerate(prompt_ids) for s in range(samples)]


def greedy_accuracy(engine, tokenizer, prompt_ids: list[list[int]], labels: list[str], pool: RewardPool,
                    *, max_new_tokens: int, stop_token_ids: list[int], stop_strings: list[str] = ()) -> EvalResult:
    requests = greedy_requests(prompt_ids, max_new_tokens)
    sampling = SamplingParams(temperature=0.0, stop_token_ids=stop_token_ids, stop_strings=list(stop_strings))
    return _score(engine, tokenizer, requests, sampling, labels, pool)


def sampled_accuracy(engine, tokenizer, prompt_ids: list[list[int]], labels: list[str], pool: RewardPool,
                     *, samples: int, sampling: SamplingParams, max_new_tokens: int) -> EvalResult:
    """avg@k: the mean reward of `samples` completions per problem drawn with `sampling`.

    Sample s of problem i always has the seed (EVAL_RUN_SEED, EVAL_SEED_STEP, i, s), whatever the
    run's seed: every checkpoint of every run is judged on the same random numbers.
    """
    requests = sample_requests(prompt_ids, samples, max_new_tokens)
    return _score(engine, tokenizer, requests, sampling, [label for label in labels for _ in range(samples)], pool)


def _score(engine, tokenizer, requests: list[Request], sampling: SamplingParams, labels: list[str],
           pool: RewardPool) -> EvalResult:
    completions = engine.generate(requests, sampling)
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
    finished = [c.finish_reason == "stop" for c in completions]
    scored = pool.score(texts, labels, finished)
    rewards = scored.rewards
    n = len(texts)
    return EvalResult(
        accuracy=sum(rewards) / n,
        boxed_rate=sum(has_box(t) for t in texts) / n,
        truncated_rate=sum(not f for f in finished) / n,
        n=n,
        texts=texts,
        rewards=rewards,
        unscored=Unscored().add(scored),
    )
