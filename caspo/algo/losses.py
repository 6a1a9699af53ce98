"""Policy and value losses over padded ``[B, T]`` tokens.

Every loss returns ``(loss, metrics)``: a scalar reduced with ``aggregate(…, agg,
denom=denom)`` and a dict of detached 0-d tensors (masked means over valid tokens).
Inputs are zeroed at padded positions first, so junk there (NaN, inf) reaches
neither the loss nor the gradient.
"""

from __future__ import annotations

import torch

from caspo.algo.stats import aggregate, masked_fill_zero, masked_mean

MAX_LOG_RATIO = 20.0  # exp(±20) keeps ratios finite in fp32


def _ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """r = exp(clamp(logp − logp_old, ±20))."""
    return torch.exp((logp - logp_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip):
    """Per-token PPO surrogate and the masks of tokens hit by each clip.

        L1 = −A·r,  L2 = −A·clip(r, 1 − clip_low, 1 + clip_high),  Lc = max(L1, L2)
        dual clip (A < 0):  ℓ = min(Lc, −A·c)
    """
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    lower = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg3 = -advantages * dual_clip
        negative = advantages < 0
        lower = negative & (loss > pg3)
        loss = torch.where(negative, torch.minimum(loss, pg3), loss)
    return loss, clipped, lower


def _metric(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(x.detach().to(torch.float32), mask)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (optionally dual-clipped).

        r  = exp(clamp(logp − logp_old, ±20))
        ℓ  = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))
        ℓ  = min(ℓ, −A·c)            for A < 0, when dual_clip = c (c > 1)
        loss = agg(ℓ)

    The gradient is −A·r·∇logp where the unclipped term is active and 0 where a
    clip bound is. Metrics: ``clipfrac`` = mmean[L2 > L1], ``clipfrac_lower`` =
    mmean[A < 0 and the dual-clip bound is active], ``approx_kl`` =
    mmean(½(logp − logp_old)²) (the k2 estimator, ≥ 0), ``ratio_mean`` = mmean(r).
    """
    keep = mask.bool()
    logp, logp_old, advantages = (masked_fill_zero(t, keep) for t in (logp, logp_old, advantages))
    ratio = _ratio(logp, logp_old)
    per_token, clipped, lower = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    loss = aggregate(per_token, keep, agg, denom=denom)
    metrics = {
        "clipfrac": _metric(clipped, keep),
        "clipfrac_lower": _metric(lower, keep),
        "approx_kl": _metric(0.5 * (logp - logp_old).square(), keep),
        "ratio_mean": _metric(ratio, keep),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (verl's ``compute_value_loss``).

        V_clip = clamp(V, V_old − clip, V_old + clip)
        loss   = ½ · agg(max((V − R)², (V_clip − R)²))

    ``clip=None`` gives the plain ½·agg((V − R)²). Metric ``vf_clipfrac`` =
    mmean[(V_clip − R)² > (V − R)²]. Clamping V itself keeps V_clip bit-equal to V
    inside the band (V_old + (V − V_old) is not, in floating point), so an element
    that was not clipped is never counted.
    """
    keep = mask.bool()
    values, values_old, returns = (masked_fill_zero(t, keep) for t in (values, values_old, returns))
    unclipped = (values - returns).square()
    if clip is None:
        clipped = unclipped
    else:
        v_clip = torch.clamp(values, values_old - clip, values_old + clip)
        clipped = (v_clip - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), keep, agg, denom=denom)
    return loss, {"vf_clipfrac": _metric(clipped > unclipped, keep)}


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weight_bounds: tuple[float | None, float | None] | None = (0.5, 2.0),
    dual_clip: float | None = None,
    agg: str = "token-mean",
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2021; AReaL): clip against the proximal policy,
    correct for the behaviour policy with a bounded, detached weight.

        r = exp(clamp(logp − logp_prox, ±20))                      π_θ / π_prox
        ρ = exp(clamp(logp_prox − logp_behaviour, ±20))             π_prox / μ
        w = sg(clamp(ρ, lo, hi))                                   (lo, hi) = weight_bounds
        loss = agg(w · ℓ_ppo(r, A))                                ℓ_ppo as in ppo_clip_loss

    The surrogate is clipped first, then weighted. ``logp_prox`` must be recomputed by
    the trainer before the update; reusing ``logp_behaviour`` makes w ≡ 1 and clips
    against the wrong policy. ``weight_bounds=None`` (or a None side) leaves ρ unbounded.
    Metrics: those of ``ppo_clip_loss`` (on r) plus ``iw_mean``, ``iw_min``, ``iw_max``
    of the raw ρ before clamping and ``iw_clamped_frac`` = mmean[w ≠ ρ].
    """
    keep = mask.bool()
    logp, logp_prox, logp_behaviour, advantages = (
        masked_fill_zero(t, keep) for t in (logp, logp_prox, logp_behaviour, advantages)
    )
    ratio = _ratio(logp, logp_prox)
    per_token, clipped, lower = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    rho = _ratio(logp_prox, logp_behaviour).detach()
    low, high = weight_bounds if weight_bounds is not None else (None, None)
    weight = rho.clamp(min=low, max=high) if (low is not None or high is not None) else rho
    loss = aggregate(weight * per_token, keep, agg, denom=denom)

    rho32 = rho.to(torch.float32)
    any_token = keep.any()
    zero = torch.zeros((), dtype=torch.float32, device=rho.device)
    metrics = {
        "clipfrac": _metric(clipped, keep),
        "clipfrac_lower": _metric(lower, keep),
        "approx_kl": _metric(0.5 * (logp - logp_prox).square(), keep),
        "ratio_mean": _metric(ratio, keep),
        "iw_mean": _metric(rho32, keep),
        "iw_min": torch.where(any_token, torch.where(keep, rho32, float("inf")).min(), zero),
        "iw_max": torch.where(any_token, torch.where(keep, rho32, float("-inf")).max(), zero),
        "iw_clamped_frac": _metric(weight != rho, keep),
    }
    return loss, metrics


def divergence_gate_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    divergence: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float = 0.01,
    agg: str = "token-mean",
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full-vocabulary divergence gate (categorical Flow-DPPO), no ratio clipping.

    ``logp`` / ``old_logp`` are ``[B, T]`` log-probs of the sampled tokens under the
    current and the frozen old policy; ``divergence`` ``[B, T]`` is the per-token
    D_t = KL(π_old ‖ π_θ) over the whole vocabulary, no grad
    (`caspo.algo.head_categorical_kl` computes it without the full logits).

        r_t       = exp(clamp(log π_θ(a_t) − log π_old(a_t), ±20))
        outward_t = (A_t > 0 ∧ r_t > 1) ∨ (A_t < 0 ∧ r_t < 1)
        blocked_t = outward_t ∧ D_t > threshold
        ℓ_t       = −A_t · (sg(r_t) if blocked_t else r_t)
        loss      = agg(ℓ)

    Blocked tokens keep their value but get no gradient; moves back toward the old
    policy are never blocked. Metrics: ``blocked_frac`` = mmean[blocked],
    ``categorical_kl`` = mmean(D), ``ratio_mean`` = mmean(r).
    """
    keep = mask.bool()
    advantages = masked_fill_zero(advantages, keep)
    logp = masked_fill_zero(logp, keep)
    old_logp = masked_fill_zero(old_logp.to(device=logp.device, dtype=logp.dtype), keep)
    ratio = _ratio(logp, old_logp)

    with torch.no_grad():
        divergence = masked_fill_zero(divergence.to(device=logp.device, dtype=torch.float32), keep)
        outward = ((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1))
        blocked = outward & (divergence > threshold) & keep

    gated_ratio = torch.where(blocked, ratio.detach(), ratio)
    loss = aggregate(-advantages * gated_ratio, keep, agg, denom=denom)
    metrics = {
        "blocked_frac": _metric(blocked, keep),
        "categorical_kl": _metric(divergence, keep),
        "ratio_mean": _metric(ratio, keep),
    }
    return loss, metrics


# The trust region's default δ per divergence (Qi et al. 2026): binary TV 0.15, binary KL 0.05.
DPPO_DELTA = {"tv": 0.15, "kl": 0.05}


def dppo_binary_loss(
    logp: torch.Tensor,
    logp_anchor: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    divergence: str = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float | None = 10.0,
    agg: str = "token-mean",
    denom: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Divergence PPO with a binary trust-region mask on the sampled token (Qi et al. 2026).

    With p = exp(logp) and p_a = exp(logp_anchor):

        tv:  invalid = (A > 0 ∧ p − p_a > δ_high) ∨ (A ≤ 0 ∧ p − p_a < −δ_low)
        kl:  D = p_a·log(p_a/p) + (1 − p_a)·log((1 − p_a + 1e-8)/(1 − p + 1e-8))
             invalid = (A > 0 ∧ p > p_a ∧ D > δ_high) ∨ (A ≤ 0 ∧ p < p_a ∧ D > δ_low)

        r    = exp(clamp(logp − logp_anchor, ±20))
        ℓ    = −A · sg(min(r, ratio_cap)) · logp · [not invalid]
        loss = agg(ℓ)

    δ_high bounds moves that raise p (A > 0), δ_low moves that lower it (A ≤ 0); None takes the
    paper's default for the divergence (``DPPO_DELTA``: 0.15 for ``tv``, 0.05 for ``kl``). The gradient is
    −A·min(r, cap)·∇logp on valid tokens; the value uses logp, so it is not
    comparable to a PPO loss value. Metric ``dppo_masked_frac`` = mmean[invalid].
    """
    if divergence not in DPPO_DELTA:
        raise ValueError(f"unknown DPPO divergence {divergence!r}; valid: {', '.join(DPPO_DELTA)}")
    delta_low = DPPO_DELTA[divergence] if delta_low is None else delta_low
    delta_high = DPPO_DELTA[divergence] if delta_high is None else delta_high
    keep = mask.bool()
    logp, logp_anchor, advantages = (masked_fill_zero(t, keep) for t in (logp, logp_anchor, advantages))
    with torch.no_grad():
        p, p_a = logp.exp(), logp_anchor.exp()
        up, down = advantages > 0, advantages <= 0
        if divergence == "tv":
            invalid = (up & (p - p_a > delta_high)) | (down & (p - p_a < -delta_low))
        else:
            d = p_a * (logp_anchor - logp) + (1 - p_a) * torch.log((1 - p_a + 1e-8) / (1 - p + 1e-8))
            invalid = (up & (p > p_a) & (d > delta_high)) | (down & (p < p_a) & (d > delta_low))
        invalid = invalid & keep
        weight = _ratio(logp, logp_anchor)
        if ratio_cap is not None:
            weight = weight.clamp(max=ratio_cap)

    per_token = torch.where(invalid, torch.zeros_like(logp), -advantages * weight * logp)
    loss = aggregate(per_token, keep, agg, denom=denom)
    return loss, {"dppo_masked_frac": _metric(invalid, keep)}
