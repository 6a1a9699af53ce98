"""Sampled held-out accuracy (avg@k): which requests it makes and how it averages."""

from types import SimpleNamespace

import pytest

from caspo.eval.heldout import EVAL_RUN_SEED, EVAL_SEED_STEP, sampled_accuracy
from caspo.reward import RewardResult
from caspo.rollout.base import Completion, SamplingParams
from caspo.rollout.sampling import sample_seed


class EchoEngine:
    """Answers each request with its prompt's first token as text; records what it was asked."""

    def __init__(self):
        self.calls = []

    def generate(self, requests, sampling):
        self.calls.append((requests, sampling))
        return [Completion([r.prompt_ids[0] + r.seed % 2], [0.0], "stop", 0) for r in requests]


def test_sampled_accuracy_averages_k_seeded_samples_per_problem():
    engine = EchoEngine()
    tokenizer = SimpleNamespace(decode=lambda tokens, skip_special_tokens: str(tokens[0]))
    pool = SimpleNamespace(score=lambda texts, labels, finished: RewardResult(
        [float(t == label) for t, label in zip(texts, labels)]))
    sampling = SamplingParams(temperature=0.7)
    result = sampled_accuracy(engine, tokenizer, [[10], [20]], ["10", "21"], pool,
                              samples=3, sampling=sampling, max_new_tokens=5)

    (requests, used), = engine.calls
    assert used is sampling  # the run's sampler, not greedy
    assert [r.prompt_ids for r in requests] == [[10]] * 3 + [[20]] * 3  # problem-major
    assert [r.seed for r in requests] == [sample_seed(EVAL_RUN_SEED, EVAL_SEED_STEP, i, s)
                                         for i in range(2) for s in range(3)]
    assert all(r.max_new_tokens == 5 for r in requests)
    # a sample is right when its seed's parity matches the label's offset from the prompt
    expected = [float(r.seed % 2 == 0) for r in requests[:3]] + [float(r.seed % 2 == 1) for r in requests[3:]]
    assert result.rewards == expected and result.n == 6
    assert result.accuracy == pytest.approx(sum(expected) / 6)
    again = sampled_accuracy(EchoEngine(), tokenizer, [[10], [20]], ["10", "21"], pool,
                             samples=3, sampling=sampling, max_new_tokens=5)
    assert again.rewards == result.rewards  # same random numbers every time


def test_sampled_accuracy_needs_a_sample():
    with pytest.raises(ValueError, match="samples per held-out problem"):
        sampled_accuracy(EchoEngine(), None, [[1]], ["1"], None, samples=0, sampling=SamplingParams(),
                         max_new_tokens=5)
