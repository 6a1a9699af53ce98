"""IPVRM's ADB and DLW (arXiv 2604.13197 Eq. 15) for CASPO's online value update: hand-computed values,
the paper's formula and the released code's sign convention, the online step, and the config's checks."""

import math

import pytest
import torch
from value_checks import batch_of, online_values

from caspo.algo import ipvrm
from caspo.config import ConfigError, load_config
from caspo.methods import resolve_method

REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 5, 5])  # μ = 3/4, 0, 1/2


def test_group_means_and_the_two_balances_by_hand():
    torch.testing.assert_close(ipvrm.group_means(REWARDS, GROUPS), torch.tensor([.75] * 4 + [0.0] * 2 + [.5] * 2))
    floor = math.log(1e-6 / (1 - 1e-6))  # μ = 0 clamped to ε
    torch.testing.assert_close(ipvrm.difficulty_boundary(REWARDS, GROUPS),
                               torch.tensor([math.log(3)] * 4 + [floor] * 2 + [0.0, 0.0]))
    # the rarer outcome of a prompt weighs more; a prompt whose samples all agree weighs 0
    torch.testing.assert_close(ipvrm.outcome_weights(REWARDS, GROUPS),
                               torch.tensor([.25, .25, .25, .75, 0.0, 0.0, .5, .5]))


def test_balanced_bce_is_eq15_without_margin_and_the_released_codes_convention():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, 3, generator=g)
    shift, weight = ipvrm.difficulty_boundary(REWARDS, GROUPS), ipvrm.outcome_weights(REWARDS, GROUPS)
    got = ipvrm.balanced_value_bce(z, REWARDS, shift, weight)
    r, V, w = REWARDS[:, None], shift[:, None], weight[:, None]
    eq15 = -w * (r * torch.sigmoid(z + V).log() + (1 - r) * (1 - torch.sigmoid(z + V)).log())
    torch.testing.assert_close(got, eq15, atol=1e-5, rtol=1e-5)
    # released code: margin m − V for a correct sample, m + V for a wrong one, loss −log σ(s·z − margin), m = 0
    s = 2 * r - 1
    margin = torch.where(r > 0.5, -V, V)
    torch.testing.assert_close(got, -w * torch.nn.functional.logsigmoid(s * z - margin), atol=1e-5, rtol=1e-5)
    # off: the plain BCE CASPO used before
    plain = ipvrm.balanced_value_bce(z, REWARDS, torch.zeros(8), torch.ones(8))
    torch.testing.assert_close(plain, torch.nn.functional.binary_cross_entropy_with_logits(
        z, r.expand_as(z), reduction="none"))
    # one value by hand: z = 0, μ = 3/4, correct: −(1/4)·log σ(log 3) = −(1/4)·log(3/4)
    one = ipvrm.balanced_value_bce(torch.zeros(1, 1), torch.ones(1), torch.tensor([math.log(3)]),
                                   torch.tensor([.25]))
    assert one.item() == pytest.approx(-0.25 * math.log(0.75), rel=1e-6)


def test_the_online_step_weighs_and_shifts_as_ipvrm(value_model_folder):
    """φ = reference, so every V(s_k) = 0 and each boundary's loss is w·BCE(V(x), r): 2 boundaries per row."""
    state = online_values(value_model_folder, "method.caspo.use_adb=true", "method.caspo.use_dlw=true")
    out = state.online_step(batch_of(REWARDS, GROUPS), micro_batch_size=3)
    shift, weight = ipvrm.difficulty_boundary(REWARDS, GROUPS), ipvrm.outcome_weights(REWARDS, GROUPS)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(shift, REWARDS, reduction="none")
    assert out["value_boundaries"] == 16
    assert out["value_bce"] == pytest.approx(float((weight * 2 * bce).sum() / 16), rel=1e-5)
    assert state.online.optimizer.state and all(p.grad is None for p in state.model.policy.parameters())  # freed
    plain = online_values(value_model_folder).online_step(batch_of(REWARDS, GROUPS), micro_batch_size=3)
    assert plain["value_bce"] == pytest.approx(math.log(2), rel=1e-5)  # BCE(0, r) = log 2 everywhere


def test_with_dlw_prompts_whose_samples_agree_teach_nothing(value_model_folder):
    state = online_values(value_model_folder, "method.caspo.use_dlw=true")
    before = [p.detach().clone() for p in state.model.policy.parameters()]
    out = state.online_step(batch_of(torch.tensor([1.0] * 4 + [0.0] * 4), torch.tensor([0] * 4 + [1] * 4)), 4)
    assert out["value_bce"] == 0.0 and out["value_grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.policy.parameters()))


@pytest.mark.parametrize("overrides, named", [
    (["method.name=caspo", "method.caspo.value_model=v", "method.caspo.use_adb=true"], "online=false"),
    (["method.name=grpo", "method.caspo.use_dlw=true"], "got grpo"),
    (["method.name=caspo", "method.caspo.value_model=v", "method.caspo.online=true", "method.caspo.use_dlw=true",
      "rollout.samples_per_prompt=1"], "samples_per_prompt >= 2"),
])
def test_the_balances_need_caspos_online_update_over_groups(overrides, named):
    with pytest.raises(ConfigError, match=named):
        resolve_method(load_config("tests", overrides))

