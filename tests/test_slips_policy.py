"""The shipped slips policy does what its preset says: greedy solutions are right, sampled lines slip."""

import dataclasses
import re

import pytest

from caspo.config import load_config
from caspo.data.build import load_task_data
from caspo.rollout.base import Request
from caspo.value.rollout import rollout_setup

LINE = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def line_slips(text: str) -> list[int]:
    """For each computation line: how far its result lies above a op b (0 when right)."""
    out = []
    for a, op, b, result in LINE.findall(text):
        a, b, result = int(a), int(b), int(result)
        out.append(result - {"+": a + b, "-": a - b, "*": a * b}[op])
    return out


@pytest.mark.slow  # about 12 s: 1,000 sampled solutions
def test_shipped_slips_policy_slips_only_when_sampling():
    cfg = load_config("arith-slips", ["rollout.backend=native", "model.threads=1"])
    setup = rollout_setup(cfg)
    prompts = load_task_data(cfg, setup.tokenizer).eval_prompts[:48]
    greedy = setup.engine.generate([Request(p, 0, 96) for p in prompts],
                                   dataclasses.replace(setup.sampling, temperature=0.0))
    sampled = setup.engine.generate([Request(p, s, 96) for p in prompts for s in range(4)], setup.sampling)

    greedy_slips = [d for c in greedy for d in line_slips(setup.decode(c.tokens))]
    sampled_slips = [d for c in sampled for d in line_slips(setup.decode(c.tokens))]
    assert len(greedy_slips) >= 2 * len(prompts) and len(sampled_slips) >= 8 * len(prompts)
    assert sum(d != 0 for d in greedy_slips) <= 1  # the mode of each line is its right result
    rate = sum(d != 0 for d in sampled_slips) / len(sampled_slips)
    assert 0.1 < rate < 0.3  # its SFT data slipped 15% of their lines; the model slips a little more (22% here)
    wrong = [d for d in sampled_slips if d != 0]
    assert sum(1 <= d <= 3 for d in wrong) >= 0.8 * len(wrong)  # mostly upwards, by 1-3, as in its SFT data
