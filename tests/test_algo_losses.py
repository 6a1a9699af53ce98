import math

import pytest
import torch

from caspo.algo import (
    aggregate_denom,
    decoupled_ppo_loss,
    divergence_gate_loss,
    dppo_binary_loss,
    head_categorical_kl,
    kl,
    ppo_clip_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")
f64 = torch.float64


def leaf(values):
    return torch.tensor(values, dtype=f64, requires_grad=True)


def row(values):
    return torch.tensor([values], dtype=f64)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def assert_detached_scalars(metrics):
    for name, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, name
        assert torch.isfinite(value), name


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logp = torch.tensor([0.5, -1.0, 0.0])
    ref = torch.zeros(3)
    torch.testing.assert_close(kl(logp, ref, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl(logp, ref, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    # k3: e^{-0.5} + 0.5 − 1 = 0.1065307,  e^{1} − 1 − 1 = 0.7182818
    torch.testing.assert_close(kl(logp, ref, "k3"), torch.tensor([0.1065307, 0.7182818, 0.0]))
    torch.testing.assert_close(kl(logp, ref, "abs"), torch.tensor([0.5, 1.0, 0.0]))
    torch.testing.assert_close(kl(torch.tensor([2.0]), torch.tensor([3.0]), "k1"), torch.tensor([-1.0]))


def test_k3_clamps():
    logp = torch.tensor([-3.0, 25.0, -25.0, 12.0], requires_grad=True)
    out = kl(logp, torch.zeros(4), "k3")
    # d = −3: e³ − 4 = 16.09 → 10;  d = 25 → 20: e^{-20} + 19 → 10;  d = −25 → −20: e²⁰ − 21 → 10
    # d = 12: e^{-12} + 11 → 10
    torch.testing.assert_close(out, torch.full((4,), 10.0))
    assert torch.isfinite(out).all()
    # clamped values carry no gradient
    assert (grad_of(out.sum(), logp) == 0).all()


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k3"):
        kl(torch.zeros(1), torch.zeros(1), "low_var")


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_values_gradients_and_metrics():
    # logp_old = 0, so r = exp(logp)
    r = [1.1, 1.5, 0.5, 0.5, 1.5, 1.199, 1.201]
    A = [1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    logp = leaf([[math.log(x) for x in r]])
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 7, dtype=f64), row(A), torch.ones(1, 7), agg="token-sum")
    # per token  max(−A·r, −A·clip(r, .8, 1.2)):
    #   A=+1 r=1.1:  −1.1 (inside)         A=+1 r=1.5: max(−1.5, −1.2) = −1.2 (clipped)
    #   A=+1 r=0.5:  max(−.5, −.8) = −.5    A=−1 r=0.5: max(.5, .8)   = .8   (clipped)
    #   A=−1 r=1.5:  max(1.5, 1.2) = 1.5    A=+1 r=1.199: −1.199 (inside), r=1.201: −1.2 (clipped)
    expected = [-1.1, -1.2, -0.5, 0.8, 1.5, -1.199, -1.2]
    assert loss.item() == pytest.approx(sum(expected))
    # ∂ℓ/∂logp = −A·r where the unclipped term is active, 0 where clipped
    expected_grad = [-1.1, 0.0, -0.5, 0.0, 1.5, -1.199, 0.0]
    torch.testing.assert_close(grad_of(loss, logp), row(expected_grad))

    assert_detached_scalars(metrics)
    assert metrics["clipfrac"].item() == pytest.approx(3 / 7)
    assert metrics["clipfrac_lower"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx(sum(r) / 7)
    assert metrics["approx_kl"].item() == pytest.approx(sum(0.5 * math.log(x) ** 2 for x in r) / 7)


def test_ppo_clip_gradient_exactly_at_the_boundary_is_unclipped():
    # clip_high = 0 puts the upper boundary at r = 1 exactly; the value is continuous there and
    # the gradient is the unclipped one (−A·r), matching the inside of the trust region.
    logp = leaf([[0.0, 0.0]])
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 2, dtype=f64), row([2.0, -3.0]), torch.ones(1, 2),
                                  clip_low=0.0, clip_high=0.0, agg="token-sum")
    assert loss.item() == pytest.approx(-2.0 + 3.0)
    torch.testing.assert_close(grad_of(loss, logp), row([-2.0, 3.0]))
    assert metrics["clipfrac"].item() == 0.0


def test_ppo_dual_clip():
    # A = −2: r = 4 → Lc = max(8, 2.4) = 8, capped at −A·c = 6 (no gradient)
    #         r = 2 → Lc = 4 < 6, untouched, gradient −A·r = 4
    # A = +1, r = 4 → Lc = max(−4, −1.2) = −1.2, dual clip leaves A > 0 alone
    logp = leaf([[math.log(4.0), math.log(2.0), math.log(4.0)]])
    A = row([-2.0, -2.0, 1.0])
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 3, dtype=f64), A, torch.ones(1, 3), dual_clip=3.0,
                                  agg="token-sum")
    assert loss.item() == pytest.approx(6.0 + 4.0 - 1.2)
    torch.testing.assert_close(grad_of(loss, logp), row([0.0, 4.0, 0.0]))
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)  # only the A > 0 token has L2 > L1
    with pytest.raises(ValueError, match="dual_clip must be > 1, got 1.0"):
        ppo_clip_loss(logp, torch.zeros(1, 3, dtype=f64), A, torch.ones(1, 3), dual_clip=1.0)


def test_ppo_junk_padding_does_not_leak():
    logp = torch.tensor([[math.log(1.1), NAN, INF], [0.0, -INF, NAN]], dtype=f64, requires_grad=True)
    old = torch.tensor([[0.0, INF, NAN], [0.0, NAN, 3.0]], dtype=f64)
    A = torch.tensor([[1.0, NAN, -INF], [-1.0, INF, NAN]], dtype=f64)
    mask = torch.tensor([[1, 0, 0], [1, 0, 0]])
    loss, metrics = ppo_clip_loss(logp, old, A, mask)
    # token-mean of −1.1 and +1.0
    assert loss.item() == pytest.approx((-1.1 + 1.0) / 2)
    grad = grad_of(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 2, 0.0, 0.0], [1.0 / 2, 0.0, 0.0]], dtype=f64))
    assert_detached_scalars(metrics)


def test_ppo_loss_with_global_denom_over_micro_batches():
    gen = torch.Generator().manual_seed(3)
    B, T = 4, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    logp = (0.3 * torch.randn(B, T, generator=gen, dtype=f64)).requires_grad_()
    old = 0.3 * torch.randn(B, T, generator=gen, dtype=f64)
    A = torch.randn(B, T, generator=gen, dtype=f64)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        full, _ = ppo_clip_loss(logp, old, A, mask, agg=agg)
        denom = aggregate_denom(mask, agg)
        split = sum(ppo_clip_loss(logp[i : i + 1], old[i : i + 1], A[i : i + 1], mask[i : i + 1], agg=agg,
                                  denom=denom)[0] for i in range(B))
        torch.testing.assert_close(grad_of(split, logp), grad_of(full, logp), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- value loss


def test_value_loss_clipping_by_hand():
    V = leaf([[1.0, 0.6, 0.0, 1.0, NAN]])
    V_old = row([0.5, 0.5, 0.5, 0.5, INF])
    R = row([2.0, 1.0, 0.1, 0.0, NAN])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(V, V_old, R, mask, clip=0.2)
    # token: V_clip = clip(V, V_old ± .2);   (V − R)²  vs  (V_clip − R)²
    #   1: V_clip .7   1    vs 1.69 → 1.69 (clipped, no gradient)
    #   2: V_clip .6   .16  vs .16  → .16
    #   3: V_clip .3   .01  vs .04  → .04  (clipped)
    #   4: V_clip .7   1    vs .49  → 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.16 + 0.04 + 1.0) / 4)
    assert metrics["vf_clipfrac"].item() == pytest.approx(2 / 4)
    assert_detached_scalars(metrics)
    # ∂/∂V of ½·mean: (V − R)/4 on unclipped tokens; token 2 ties (both branches share ∂ = V − R)
    torch.testing.assert_close(grad_of(loss, V), row([0.0, -0.4 / 4, 0.0, 1.0 / 4, 0.0]))

    plain, _ = value_loss(V, V_old, R, mask, clip=None)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 0.16 + 0.01 + 1.0) / 4)


def test_value_loss_counts_no_clip_inside_the_band_in_fp32():
    # V and V_old within 0.19 of each other, of mixed magnitudes: V_old + (V − V_old) often differs from V
    # in its last bit (a third of these), which counted some as clipped; clamp(V, V_old ± c) is V itself
    g = torch.Generator().manual_seed(0)
    V_old = (torch.rand(1, 4096, generator=g) * 2 - 1) * 0.1
    V = ((torch.rand(1, 4096, generator=g) * 2 - 1) * 0.09).requires_grad_()
    R = torch.randn(1, 4096, generator=g)
    mask = torch.ones(1, 4096)
    assert bool((V_old + (V - V_old).clamp(-0.2, 0.2) != V).any())  # the float trap is real on these vectors
    loss, metrics = value_loss(V, V_old, R, mask, clip=0.2)
    plain, _ = value_loss(V, V_old, R, mask, clip=None)
    assert metrics["vf_clipfrac"].item() == 0.0
    assert loss.item() == plain.item()
    torch.testing.assert_close(grad_of(loss, V), grad_of(plain, V), rtol=0, atol=0)


def test_value_loss_matches_the_verl_formula_elementwise():
    """verl: V_c = clip(V, V_old − c, V_old + c); ½·masked_mean(max((V − R)², (V_c − R)²)); ∂ through the max."""
    V_list = [0.30, -0.45, 1.10, 0.05, 0.70, -0.20]
    V_old_list = [0.00, -0.10, 0.50, 0.05, 0.80, 0.10]
    R_list = [1.00, -1.00, 0.00, 2.00, 0.75, -0.30]
    c = 0.25
    terms, grads, clipped = [], [], []
    for v, vo, r in zip(V_list, V_old_list, R_list):
        vc = min(max(v, vo - c), vo + c)
        plain, clip_term = (v - r) ** 2, (vc - r) ** 2
        terms.append(max(plain, clip_term))
        clipped.append(clip_term > plain)
        # the max picks the clipped branch: ∂ = 2(V_c − R)·∂V_c, and ∂V_c = 0 outside the band
        inside = vo - c < v < vo + c
        grads.append(2 * (v - r) if clip_term <= plain else (2 * (vc - r) if inside else 0.0))
    n = len(V_list)
    V = leaf([V_list])
    loss, metrics = value_loss(V, row(V_old_list), row(R_list), torch.ones(1, n), clip=c)
    assert loss.item() == pytest.approx(0.5 * sum(terms) / n, rel=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(sum(clipped) / n)
    assert 0 < sum(clipped) < n  # both branches are exercised
    torch.testing.assert_close(grad_of(loss, V), row([0.5 * g / n for g in grads]))


# ---------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_weights_clamped_and_detached():
    # ρ = π_prox/μ = [3, 0.25, 1.5] → w = clamp(ρ, .5, 2) = [2, .5, 1.5]; π_θ = π_prox (r = 1)
    prox = row([math.log(0.6), math.log(0.1), math.log(0.3)])
    behaviour = torch.tensor([[math.log(0.2), math.log(0.4), math.log(0.2)]], dtype=f64, requires_grad=True)
    logp = prox.clone().requires_grad_()
    A = row([1.0, 1.0, -1.0])
    mask = torch.ones(1, 3)
    loss, metrics = decoupled_ppo_loss(logp, prox, behaviour, A, mask, agg="token-sum")
    # ℓ = w·(−A·r) = [−2, −.5, 1.5]
    assert loss.item() == pytest.approx(-2.0 - 0.5 + 1.5)
    g_logp, g_beh = torch.autograd.grad(loss, (logp, behaviour), allow_unused=True)
    torch.testing.assert_close(g_logp, row([-2.0, -0.5, 1.5]))
    assert g_beh is None  # the weight is a constant
    assert_detached_scalars(metrics)
    assert metrics["iw_mean"].item() == pytest.approx((3 + 0.25 + 1.5) / 3)
    assert metrics["iw_min"].item() == pytest.approx(0.25)
    assert metrics["iw_max"].item() == pytest.approx(3.0)
    assert metrics["iw_clamped_frac"].item() == pytest.approx(2 / 3)

    # Passing the behaviour log-probs as proximal: w ≡ 1 and r = π/μ = [3, .25, 1.5], so
    # ℓ = [max(−3, −1.2), max(−.25, −.8), max(1.5, 1.2)] = [−1.2, −.25, 1.5]: a different loss.
    merged, merged_metrics = decoupled_ppo_loss(logp, behaviour.detach(), behaviour.detach(), A, mask, agg="token-sum")
    assert merged.item() == pytest.approx(-1.2 - 0.25 + 1.5)
    assert merged.item() != pytest.approx(loss.item())
    assert merged_metrics["iw_clamped_frac"].item() == 0.0


def test_decoupled_ppo_clips_then_weights():
    # r = π/π_prox = 1.5 with A = +1 is clipped to −1.2, then weighted by w = 2 → −2.4, no gradient;
    # dual clip: A = −1, r = 4 → min(max(4, 1.2), 3) = 3, weighted by w = .5 → 1.5
    logp = leaf([[math.log(1.5), math.log(4.0)]])
    prox = row([0.0, 0.0])
    behaviour = row([-math.log(2.0), math.log(2.0)])  # ρ = [2, .5]
    loss, metrics = decoupled_ppo_loss(logp, prox, behaviour, row([1.0, -1.0]), torch.ones(1, 2), dual_clip=3.0,
                                       agg="token-sum")
    assert loss.item() == pytest.approx(-2.4 + 1.5)
    torch.testing.assert_close(grad_of(loss, logp), row([0.0, 0.0]))
    assert metrics["clipfrac_lower"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------- divergence gate


OLD, FAR, NEAR = [0.5, 0.3, 0.2], [0.6, 0.25, 0.15], [0.51, 0.295, 0.195]


def gate_inputs():
    old_logp = torch.tensor([[OLD[0], OLD[0], OLD[0], INF]], dtype=f64).log()
    new_logp = torch.tensor([[FAR[0], FAR[0], NEAR[0], NAN]], dtype=f64).log().requires_grad_()
    # with an identity head the logits are the hidden states: log-probs in, the same distributions out
    eye = torch.eye(3, dtype=f64)
    divergence = head_categorical_kl(torch.tensor([OLD, OLD, OLD], dtype=f64).log(), eye,
                                     torch.tensor([FAR, FAR, NEAR], dtype=f64).log(), eye)
    divergence = torch.cat([divergence, torch.tensor([NAN], dtype=f64)])[None]  # padding: any value
    A = row([1.0, -1.0, 1.0, NAN])
    mask = torch.tensor([[1, 1, 1, 0]])
    return new_logp, old_logp, divergence, A, mask


def test_divergence_gate_blocks_outward_moves_beyond_threshold():
    new_logp, old_logp, divergence, A, mask = gate_inputs()
    loss, metrics = divergence_gate_loss(new_logp, old_logp, divergence, A, mask, threshold=0.01, agg="token-sum")
    # D(far)  = .5 ln(.5/.6) + .3 ln(.3/.25) + .2 ln(.2/.15)     = 0.0210721 > 0.01
    # D(near) = .5 ln(.5/.51) + .3 ln(.3/.295) + .2 ln(.2/.195)  = 0.0002043 < 0.01
    d_far = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.15)
    d_near = 0.5 * math.log(0.5 / 0.51) + 0.3 * math.log(0.3 / 0.295) + 0.2 * math.log(0.2 / 0.195)
    torch.testing.assert_close(divergence[0, :3], torch.tensor([d_far, d_far, d_near], dtype=f64))
    # token 0: A>0, r = 1.2 > 1, outward and far → blocked (value kept, no gradient)
    # token 1: A<0, r = 1.2 > 1 → corrective, never blocked: ℓ = 1.2, ∂ℓ/∂logp(a) = −A·r = 1.2
    # token 2: A>0, r = 1.02, outward but near → free: ℓ = −1.02, ∂ = −1.02
    assert loss.item() == pytest.approx(-1.2 + 1.2 - 1.02)
    torch.testing.assert_close(grad_of(loss, new_logp), row([0.0, 1.2, -1.02, 0.0]))
    assert metrics["blocked_frac"].item() == pytest.approx(1 / 3)
    assert metrics["categorical_kl"].item() == pytest.approx((2 * d_far + d_near) / 3)
    assert_detached_scalars(metrics)

    loose, loose_metrics = divergence_gate_loss(new_logp, old_logp, divergence, A, mask, threshold=0.05,
                                                agg="token-sum")
    assert loose_metrics["blocked_frac"].item() == 0.0
    assert grad_of(loose, new_logp)[0, 0].item() == pytest.approx(-1.2)


# ---------------------------------------------------------------- DPPO binary masks


def dppo_row(p, p_anchor):
    return leaf([[math.log(x) for x in p]]), row([math.log(x) for x in p_anchor])


def test_dppo_binary_tv_mask():
    #          A     p_a   p     p − p_a
    # a       +1    .3    .5    +.2 > .15          invalid
    # b       +1    .3    .4    +.1                valid, r = 4/3
    # c       −1    .5    .3    −.2 < −.15         invalid
    # d       −1    .5    .6    +.1                valid, r = 1.2
    # e        0    .5    .3    −.2 (A ≤ 0 side)   invalid
    # f       +1    .01   .15   +.14               valid, r = 15 → cap 10
    logp, anchor = dppo_row([0.5, 0.4, 0.3, 0.6, 0.3, 0.15], [0.3, 0.3, 0.5, 0.5, 0.5, 0.01])
    A = row([1.0, 1.0, -1.0, -1.0, 0.0, 1.0])
    loss, metrics = dppo_binary_loss(logp, anchor, A, torch.ones(1, 6), divergence="tv", agg="token-sum")
    # ℓ = −A·sg(min(r, 10))·logp on valid tokens
    expected = -(4 / 3) * math.log(0.4) + 1.2 * math.log(0.6) - 10 * math.log(0.15)
    assert loss.item() == pytest.approx(expected)
    torch.testing.assert_close(grad_of(loss, logp), row([0.0, -4 / 3, 0.0, 1.2, 0.0, -10.0]))
    assert metrics["dppo_masked_frac"].item() == pytest.approx(3 / 6)
    assert_detached_scalars(metrics)


def test_dppo_binary_kl_mask_uses_delta_high_for_positive_and_delta_low_otherwise():
    # a  A=+1  p_a .3 → p .4:  D = .3 ln(.3/.4) + .7 ln(.7/.6) = 0.0216009, moved up (favoured)
    # b  A=−1  p_a .5 → p .3:  D = .5 ln(.5/.3) + .5 ln(.5/.7) = 0.0871767, moved down (favoured)
    # c  A=+1  p_a .5 → p .2:  D large but p moved against A → never masked
    logp, anchor = dppo_row([0.4, 0.3, 0.2], [0.3, 0.5, 0.5])
    A = row([1.0, -1.0, 1.0])
    mask = torch.ones(1, 3)

    _, m = dppo_binary_loss(logp, anchor, A, mask, divergence="kl", delta_low=0.05, delta_high=0.05)
    assert m["dppo_masked_frac"].item() == pytest.approx(1 / 3)  # only b (.087 > .05)

    loss, m = dppo_binary_loss(logp, anchor, A, mask, divergence="kl", delta_low=0.1, delta_high=0.02,
                               agg="token-sum")
    assert m["dppo_masked_frac"].item() == pytest.approx(1 / 3)  # only a (.0216 > .02); b (.087 < .1) valid
    # valid: b with r = .6 → ℓ = +.6·ln .3, c with r = .4 → ℓ = −.4·ln .2
    assert loss.item() == pytest.approx(0.6 * math.log(0.3) - 0.4 * math.log(0.2))
    torch.testing.assert_close(grad_of(loss, logp), row([0.0, 0.6, -0.4]))

    with pytest.raises(ValueError, match="unknown DPPO divergence 'js'; valid: "):
        dppo_binary_loss(logp, anchor, A, mask, divergence="js")


def test_dppo_binary_default_delta_is_the_papers_for_each_divergence():
    # A=+1, p_a .1 → p .24: p − p_a = .14 (inside TV's .15);
    # D = .1 ln(.1/.24) + .9 ln(.9/.76) = 0.0646161 (outside KL's .05, inside .15)
    logp, anchor = dppo_row([0.24], [0.1])
    A, mask = row([1.0]), torch.ones(1, 1)
    masked = {}
    for divergence, deltas in (("tv", {}), ("kl", {}), ("kl", {"delta_low": 0.15, "delta_high": 0.15})):
        _, m = dppo_binary_loss(logp, anchor, A, mask, divergence=divergence, **deltas)
        masked[divergence, bool(deltas)] = m["dppo_masked_frac"].item()
    assert masked == {("tv", False): 0.0, ("kl", False): 1.0, ("kl", True): 0.0}


def test_dppo_methods_take_their_divergences_default_delta_unless_set():
    from types import SimpleNamespace

    from caspo.config import MethodConfig
    from caspo.train.policy_losses import DPPO_KL, DPPO_TV, LossInputs

    logp, anchor = dppo_row([0.24], [0.1])  # the token above: masked at δ = .05 under KL only
    batch = SimpleNamespace(old_logprobs=anchor, advantages=row([1.0]), response_mask=torch.ones(1, 1))
    inputs = LossInputs(logp=logp, batch=batch, denom=None)
    assert MethodConfig().dppo_delta_low is None and MethodConfig().dppo_delta_high is None
    assert DPPO_KL.fn(inputs, MethodConfig())[1]["dppo_masked_frac"].item() == 1.0
    assert DPPO_TV.fn(inputs, MethodConfig())[1]["dppo_masked_frac"].item() == 0.0
    wide = MethodConfig(dppo_delta_low=0.15, dppo_delta_high=0.15)
    assert DPPO_KL.fn(inputs, wide)[1]["dppo_masked_frac"].item() == 0.0


def test_dppo_junk_padding_does_not_leak():
    logp = torch.tensor([[math.log(0.4), NAN]], dtype=f64, requires_grad=True)
    anchor = row([math.log(0.3), INF])
    loss, metrics = dppo_binary_loss(logp, anchor, row([1.0, NAN]), torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-(4 / 3) * math.log(0.4))
    torch.testing.assert_close(grad_of(loss, logp), row([-4 / 3, 0.0]))
    assert_detached_scalars(metrics)
