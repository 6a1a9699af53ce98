"""A method defined entirely here, as a user would add one: a row plus one pure function, trained two steps."""

import json

import pytest
import torch

from caspo.config import load_config
from caspo.methods import METHODS, Method, register
from caspo.train import loop
from caspo.train.policy_losses import PPO_CLIP

SEEN: list[tuple[torch.Tensor, torch.Tensor]] = []  # (sequence scores, advantages) of every call


def leave_one_out(batch, rewards, m):
    """RLOO: A_i = s_i − mean_{j≠i, same group} s_j, broadcast to the tokens of i."""
    scores = rewards.sum(-1)
    groups = batch.group_ids
    same = (groups[:, None] == groups[None, :]).float()
    others = same.sum(-1) - 1
    baseline = (same @ scores - scores) / others
    seq = scores - baseline
    SEEN.append((scores.clone(), seq.clone()))
    return seq[:, None] * batch.response_mask, None


@pytest.fixture
def rloo():
    method = register(Method("rloo", leave_one_out, PPO_CLIP, group_baseline=True, doc="leave-one-out baseline"))
    SEEN.clear()
    yield method
    del METHODS["rloo"]


def test_a_method_defined_in_a_test_file_trains(tmp_path, rloo):
    cfg = load_config("tests", [f"train.output_dir={tmp_path}", "train.steps=2", "eval.before=false",
                                "eval.after=false", "method.name=rloo", "rollout.samples_per_prompt=3",
                                "train.minibatch_size=6", "optim.lr=1e-2"])
    before = {k: v.clone() for k, v in loop.build_trainer(cfg).policy.state_dict().items()}
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("clipfrac" in r and "grad_norm" in r for r in rows)  # the row's loss ran, and the update
    assert len(SEEN) == 2  # the row's advantage function, once per step
    for scores, seq in SEEN:  # groups of 3: A_i = s_i − (sum of the other two) / 2
        groups = scores.view(-1, 3)
        expected = groups - (groups.sum(-1, keepdim=True) - groups) / 2
        assert torch.allclose(seq.view(-1, 3), expected)
    assert any(s.max() > s.min() for s, _ in SEEN)  # and there was signal to learn from
    after = loop.build_trainer(load_config("tests", [f"model.policy={tmp_path}/checkpoints/step_000002/policy"]))
    changed = [k for k, v in after.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # two optimizer steps moved the weights
    saved = {p.name for p in (tmp_path / "checkpoints" / "step_000002").iterdir() if p.is_dir()}
    assert saved == {"policy"}  # a stateless method saves only the policy


def test_a_new_method_gets_the_row_checks(rloo):
    from caspo.config import ConfigError
    from caspo.methods import resolve_method

    with pytest.raises(ConfigError, match="rollout.samples_per_prompt must be >= 2"):
        resolve_method(load_config("tests", ["method.name=rloo", "rollout.samples_per_prompt=1",
                                             "train.minibatch_size=4", "train.micro_batch_size=2"]))
