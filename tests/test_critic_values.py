"""The critic's values pass is skipped exactly when the critic's own update step gives the same values."""

import copy

import pytest
import torch

from caspo import algo
from caspo.config import load_config
from caspo.models.critic import load_critic
from caspo.models.policy import resolve_model_path
from caspo.train import loop
from caspo.train.critic import values_are_current

pytestmark = pytest.mark.timeout(240)

ONE_MINIBATCH = ["method.name=ppo_critic", "train.minibatch_size=8", "train.micro_batch_size=2",
                 "method.critic_lr=1e-3", "eval.before=false", "eval.after=false"]


def config(tmp_path, *overrides):
    return load_config("tests", [f"train.output_dir={tmp_path}", *ONE_MINIBATCH, *overrides])


@pytest.fixture(scope="module")
def critic():
    return load_critic(resolve_model_path("embedded:tiny-arith"))


@pytest.mark.parametrize("overrides, expected", [
    ([], True),
    (["train.critic_values=recompute"], False),
    (["train.epochs_per_rollout=2"], False),
    (["train.minibatch_size=4"], False),  # two critic steps: the second reads values the first one moved
    (["rollout.staleness=1"], True),  # the critic is current whatever policy sampled the rollout
])
def test_the_rule(tmp_path, critic, overrides, expected):
    assert values_are_current(config(tmp_path, *overrides), critic) is expected


def test_dropout_keeps_the_pass(tmp_path, critic):
    with_dropout = copy.deepcopy(critic)
    with_dropout.config.attention_dropout = 0.1
    assert values_are_current(config(tmp_path), critic) and not values_are_current(config(tmp_path), with_dropout)


def two_steps(tmp_path, *overrides):
    """The second step's batch and stats: the zero-initialised head reads 0 everywhere before the first."""
    tr = loop.build_trainer(config(tmp_path, *overrides))
    with tr.pool:
        loop.outer_step(tr)
        batch, stats = loop.outer_step(tr)
    return tr, batch, stats


@pytest.mark.parametrize("micro", [[], ["train.micro_batch_tokens=40"], ["method.lam=0.95", "method.gamma=0.9"],
                                   ["method.loss_agg=seq-mean-token-sum-norm"]])  # normalised by the budget in both
def test_the_value_phase_step_equals_the_update_step(tmp_path, micro):  # λ < 1: returns from each micro-batch
    fused, batch, stats = two_steps(tmp_path / "auto", *micro)
    kept, batch_kept, stats_kept = two_steps(tmp_path / "recompute", "train.critic_values=recompute", *micro)
    assert fused.method_state.trains_in_value_phase and not kept.method_state.trains_in_value_phase
    assert torch.equal(batch.responses, batch_kept.responses)  # the same rollout
    # the critic's first forward gave the values, and its micro-batches the GAE returns: both as recomputed
    mask = batch.response_mask.bool()
    assert batch.values.abs().sum() > 0 and torch.equal(batch.values[~mask], torch.zeros(int((~mask).sum())))
    torch.testing.assert_close(batch.values, batch_kept.values, atol=1e-6, rtol=0)
    torch.testing.assert_close(batch.returns, batch_kept.returns, atol=1e-6, rtol=0)
    torch.testing.assert_close(batch.advantages, batch_kept.advantages, atol=1e-5, rtol=0)
    # the same step of both models (two of them: its micro-batches split the rows in another order, so the
    # gradient's sums round differently), and the same metrics, under the same names
    for name, model, other in [("policy", fused.policy, kept.policy),
                               ("critic", fused.method_state.learners["critic"].model,
                                kept.method_state.learners["critic"].model)]:
        moved = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), other.parameters()))
        assert moved < 1e-5, name
    initial = load_critic(resolve_model_path("embedded:tiny-arith"))
    changed = max(float((p - q).abs().max()) for p, q in zip(initial.parameters(),
                                                             fused.method_state.learners["critic"].model.parameters()))
    assert changed > 1e-4  # the critic did take its step
    for key in ("vf_loss", "critic_grad_norm", "vf_clipfrac", "grad_norm", "pg_loss"):
        assert stats[key] == pytest.approx(stats_kept[key], rel=1e-4, abs=1e-6), key  # pg_loss is about 0
    assert stats["vf_clipfrac"] == 0  # the clip is around this very forward's values
    assert stats_kept["t_value"] > 0 and not fused.engine.asleep


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_returns_at_lambda_one_do_not_depend_on_the_values(gamma):
    """What lets the value phase read the returns before the critic's forward: at λ = 1 the V terms of GAE
    telescope, leaving the discounted rewards-to-go, holes (m = 0) skipped; at λ < 1 they do not."""
    rewards = torch.tensor([[0.0, 0.5, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    values = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    _, returns = algo.gae(rewards, values, mask, gamma, 1.0)
    _, without = algo.gae(rewards, torch.zeros_like(values), mask, gamma, 1.0)
    expected = torch.tensor([[0.5 * gamma + gamma ** 2, 0.5 + gamma, 0.0, 1.0, 0.0],  # position 2 is a hole
                             [2 * gamma ** 2, 2 * gamma, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(returns, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(without, expected, atol=1e-6, rtol=0)
    _, at_095 = algo.gae(rewards, values, mask, gamma, 0.95)
    assert (at_095 - expected).abs().max() > 1e-2


def test_two_minibatches_train_the_critic_in_the_update(tmp_path):
    tr, batch, stats = two_steps(tmp_path, "train.minibatch_size=4")
    assert not tr.method_state.trains_in_value_phase
    assert tr.method_state.learner_losses() and stats["critic_grad_norm"] > 0
