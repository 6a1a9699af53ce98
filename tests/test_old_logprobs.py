"""The old-log-prob pass is skipped exactly when the update's own forward gives the same log-probs."""

import copy

import pytest
import torch

from caspo.config import load_config
from caspo.models.policy import load_policy
from caspo.train import loop
from caspo.train.update import has_dropout, old_is_current

pytestmark = pytest.mark.timeout(240)

ONE_MINIBATCH = ["train.minibatch_size=8", "train.micro_batch_size=2", "eval.before=false", "eval.after=false"]


@pytest.fixture(scope="module")
def policy():
    return load_policy("embedded:tiny-arith")


def config(tmp_path, *overrides):
    return load_config("tests", [f"train.output_dir={tmp_path}", *ONE_MINIBATCH, *overrides])


@pytest.mark.parametrize("overrides, expected", [
    ([], True),
    (["train.old_logprobs=recompute"], False),
    (["train.epochs_per_rollout=2"], False),
    (["train.minibatch_size=4"], False),  # two minibatches: the second is trained on updated weights
    (["rollout.staleness=1"], False),
    (["method.kl_reward_coef=0.01"], False),  # the KL reward reads π_old before the update
])
def test_the_rule(tmp_path, policy, overrides, expected):
    assert old_is_current(config(tmp_path, *overrides), policy) is expected


def test_dropout_keeps_the_pass(tmp_path, policy):
    assert not has_dropout(policy)
    with_dropout = copy.deepcopy(policy)
    with_dropout.config.attention_dropout = 0.1
    assert has_dropout(with_dropout) and not old_is_current(config(tmp_path), with_dropout)


def one_step(tmp_path, *overrides):
    tr = loop.build_trainer(config(tmp_path, *overrides))
    with tr.pool:
        batch, stats = loop.outer_step(tr)
    return tr, batch, stats


def test_skipping_gives_the_same_update_as_recomputing(tmp_path):
    skipped, batch, stats = one_step(tmp_path / "auto")
    kept, batch_kept, stats_kept = one_step(tmp_path / "recompute", "train.old_logprobs=recompute")
    assert batch.old_is_current and not batch_kept.old_is_current
    assert torch.equal(batch.responses, batch_kept.responses)  # the same rollout
    # the update's forward filled π_old: every response token, equal to the recomputed pass in fp32
    mask = batch.response_mask.bool()
    assert torch.isfinite(batch.old_logprobs[mask]).all()
    torch.testing.assert_close(batch.old_logprobs[mask], batch_kept.old_logprobs[mask], atol=1e-5, rtol=0)
    for p, q in zip(skipped.policy.parameters(), kept.policy.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert stats["clipfrac"] == 0 and stats["behaviour_vs_old_logp_absdiff"] == pytest.approx(
        stats_kept["behaviour_vs_old_logp_absdiff"], abs=1e-5)
    # the update's ratios π/π_old (the histogram's): exactly 1 where π_old is this very forward, 0 on padding
    assert torch.equal(batch.update_ratios[mask], torch.ones(int(mask.sum())))
    assert torch.equal(batch.update_ratios[~mask], torch.zeros(int((~mask).sum())))
    assert "update_ratio" in loop.batch_histograms(batch)
    assert stats["entropy"] > 0 and stats["entropy"] == pytest.approx(stats_kept["entropy"], rel=1e-5)


def test_two_minibatches_recompute_and_differ_from_the_current_policy(tmp_path):
    # the second minibatch is trained on weights the first one changed: π_old is not the current policy
    tr, batch, stats = one_step(tmp_path, "train.minibatch_size=4")
    assert not batch.old_is_current and stats["t_old"] > 0
    assert torch.isfinite(batch.old_logprobs).all()
    ratios = batch.update_ratios[batch.response_mask.bool()]  # the second minibatch's rows moved off 1
    assert (ratios - 1).abs().max() > 1e-4 and stats["ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-4)


def test_behaviour_takes_the_engines_scores_as_the_old_policy(tmp_path, monkeypatch):
    """train.old_logprobs=behaviour (the looped recipe's ppo and grpo): no old pass, π_old is the engine's sampling
    log-probs, and the update's ratio is taken to them."""
    calls = []
    real = loop.logprobs
    monkeypatch.setattr(loop, "logprobs", lambda model, batch, cfg: calls.append(model) or real(model, batch, cfg))
    tr, batch, stats = one_step(tmp_path, "train.old_logprobs=behaviour", "method.kl_coef=0")
    assert calls == [] and not batch.old_is_current  # neither an old pass nor the update's own forward
    assert torch.equal(batch.old_logprobs, batch.behaviour_logprobs)
    assert batch.old_logprobs.data_ptr() != batch.behaviour_logprobs.data_ptr()  # a copy: μ stays μ


@pytest.mark.parametrize("overrides, message", [
    (["method.name=dppo"], "dppo keeps them apart from the proximal policy"),
    (["method.name=flow_dppo", "train.minibatch_size=4"], "flow_dppo's loss reads its frozen old policy"),
    (["rollout.top_p=0.9"], "log-probs, which are of the truncated sampling distribution"),
    (["rollout.top_k=5"], "log-probs, which are of the truncated sampling distribution"),
])
def test_behaviour_is_refused_where_it_cannot_be_the_old_policy(tmp_path, overrides, message):
    from caspo.config import ConfigError
    from caspo.methods import resolve_method

    cfg = config(tmp_path, "train.old_logprobs=behaviour", *overrides)
    with pytest.raises(ConfigError, match=message):
        resolve_method(cfg)
    resolve_method(config(tmp_path, *overrides))  # each setting alone is accepted
