"""Advantage estimators: GAE, group-relative, terminal-reward, step-level TD; whitening over a scope.

All outputs are plain tensors without gradient; padded positions are 0.
"""

from __future__ import annotations

import torch

from caspo.algo.stats import masked_fill_zero, masked_whiten

TERMINAL_SCOPES = ("batch", "group", "off")
WHITEN_SCOPES = ("batch", "group", "off")


# Tokens per block of the vectorised GAE: the discount matrix is [GAE_BLOCK, GAE_BLOCK] float64, and the
# blocks are chained by a loop of T / GAE_BLOCK steps instead of one of T.
GAE_BLOCK = 256


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over ``[B, T]`` tokens.

    Walk t = T−1 … 0 starting from nv = g = 0:

        δ_t = r_t + γ·nv − V_t
        if m_t = 1:  g ← δ_t + γλ·g,  nv ← V_t
        if m_t = 0:  skip (the bootstrap jumps over holes such as observation tokens)

        A_t = g,   R_t = A_t + V_t

    Advantages are raw (not whitened). Both outputs are 0 where m = 0.
    With γ = λ = 1 and V = 0, A_t is the reward-to-go Σ_{t' ≥ t} m·r.

    Computed without the walk: each row's kept tokens are packed to the front, where the holes are gone
    and A_n = Σ_{j ≥ n} (γλ)^{j−n} δ_j with δ_n = r_n + γ·V_{n+1} − V_n (V past the last kept token 0);
    that sum is a float64 product with a triangular discount matrix per block of GAE_BLOCK tokens, the
    blocks chained from the last (`_discounted_suffix_sums`). A scan over T tokens is T small kernels
    per call, which on a GPU costs more than the arithmetic.
    """
    keep = mask.bool()
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    rows, length = rewards.shape
    # Pack: the n-th kept token of a row goes to column n; holes go to a spare last column, then dropped.
    packed_index = keep.long().cumsum(1) - 1
    target = torch.where(keep, packed_index, length)

    def pack(x: torch.Tensor) -> torch.Tensor:
        packed = x.new_zeros(rows, length + 1, dtype=torch.float64)
        return packed.scatter_(1, target, masked_fill_zero(x.to(torch.float64), keep))[:, :length]

    packed_values = pack(values)
    next_values = torch.nn.functional.pad(packed_values[:, 1:], (0, 1))
    deltas = pack(rewards) + gamma * next_values - packed_values
    packed_advantages = _discounted_suffix_sums(deltas, gamma * lam)
    advantages = packed_advantages.gather(1, packed_index.clamp(min=0))
    advantages = masked_fill_zero(advantages, keep).to(rewards.dtype)
    returns = advantages + masked_fill_zero(values.to(rewards.dtype), keep)  # both 0 where m = 0
    return advantages, returns


def _discounted_suffix_sums(x: torch.Tensor, discount: float, block: int = GAE_BLOCK) -> torch.Tensor:
    """y_n = Σ_{j ≥ n} discount^(j−n) · x_j along the last dimension of x [B, T] (float64).

    Within a block of b tokens y is x times the triangular matrix D[n, j] = discount^(j−n), j ≥ n; a block's
    y then adds discount^(b−n) times the next block's first y, chained from the last block.
    """
    rows, length = x.shape
    if x.numel() == 0:
        return x.clone()
    block = min(block, length)
    blocks = -(-length // block)
    x = torch.nn.functional.pad(x, (0, blocks * block - length)).view(rows, blocks, block)
    steps = torch.arange(block, device=x.device, dtype=torch.float64)
    gap = steps[None, :] - steps[:, None]  # j − n
    powers = torch.tensor(discount, dtype=torch.float64, device=x.device) ** gap.clamp(min=0)
    within = torch.where(gap >= 0, powers, 0.0)  # D[n, j]
    local = x @ within.T  # [B, blocks, b]: the sums inside each block
    carry_weight = torch.tensor(discount, dtype=torch.float64, device=x.device) ** (block - steps)  # discount^(b−n)
    out = torch.empty_like(local)
    carried = x.new_zeros(rows)
    for k in reversed(range(blocks)):
        out[:, k] = local[:, k] + carry_weight * carried[:, None]
        carried = out[:, k, 0]
    return out.view(rows, -1)[:, :length]


@torch.no_grad()
def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (GRPO), one per sequence.

        A_i = (s_i − mean_g) / (std_g + eps)      std_g unbiased (n − 1)
        A_i =  s_i − mean_g                       when std_normalize is False (Dr. GRPO)

    ``group_ids`` is a 1-D integer tensor of arbitrary labels. A group whose
    scores are all equal gets exactly 0. A group of one sample has no baseline
    and raises ValueError.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"group_advantages: scores and group_ids must be 1-D of equal length, "
            f"got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    labels, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        lonely = labels[counts < 2].tolist()
        raise ValueError(f"group_advantages: groups {lonely} have a single sample; a group needs at least 2")

    n = counts.to(scores.dtype)
    mean = torch.zeros_like(n).index_add_(0, index, scores) / n
    centered = scores - mean[index]
    if not std_normalize:
        advantages = centered
    else:
        var = torch.zeros_like(n).index_add_(0, index, centered**2) / (n - 1)
        advantages = centered / (var.sqrt()[index] + eps)
    # Rounding in the mean can leave ~1e-8 residues; equal scores carry no signal.
    low = torch.full_like(n, float("inf")).scatter_reduce_(0, index, scores, "amin")
    high = torch.full_like(n, float("-inf")).scatter_reduce_(0, index, scores, "amax")
    flat = (low == high)[index]
    return torch.where(flat, torch.zeros_like(advantages), advantages)


@torch.no_grad()
def terminal_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | None,
    scope: str,
    eps: float = 1e-6,
    std_normalize: bool = True,
) -> torch.Tensor:
    """"PPO with terminal reward" (method ``ppo``): the sequence score, standardised.

        batch:  A_i = (s_i − mean) / (std + eps)   over the whole batch, std unbiased
        group:  A_i = group_advantages(s, group_ids)
        off:    A_i = s_i

    ``std_normalize`` False keeps the centring alone (A_i = s_i − mean), as ``group_advantages`` does.

    Returns ``[B]``; every response token of sequence i takes A_i, which is GAE
    with γ = λ = 1, V = 0 and the score as the last token's reward, then
    standardised. ``group_ids`` is only read for ``group``. An all-equal batch
    (or group) gets exactly 0. With a KL penalty in the reward the trainer passes
    s_i = Σ_t r_{i,t}, the score less the response's summed penalty (as GRPO's s_i):
    one advantage per sequence, not a per-token return-to-go.
    """
    if scope == "off":
        return scores.clone() if scores.is_floating_point() else scores.to(torch.get_default_dtype())
    if scope == "batch":
        if scores.numel() < 2:
            raise ValueError("terminal_advantages: scope 'batch' needs at least 2 scores")
        return group_advantages(scores, torch.zeros_like(scores, dtype=torch.long), eps=eps,
                                std_normalize=std_normalize)
    if scope == "group":
        if group_ids is None:
            raise ValueError("terminal_advantages: scope 'group' needs group_ids")
        return group_advantages(scores, group_ids, eps=eps, std_normalize=std_normalize)
    raise ValueError(f"unknown terminal advantage scope {scope!r}; valid scopes: {', '.join(TERMINAL_SCOPES)}")


@torch.no_grad()
def step_td(
    step_rewards: torch.Tensor,
    step_values: torch.Tensor,
    step_mask: torch.Tensor,
    gamma: float = 1.0,
) -> torch.Tensor:
    """One-step TD advantage per reasoning step (VinePPO, λ = 0).

        A_k = r_k + γ·V_{k+1} − V_k

    Tensors are ``[B, S]`` with valid steps left-aligned (``step_mask`` 1). The value
    after the last valid step is 0 (terminal), so the last step gets r_K − V_K.
    A_k is 0 where ``step_mask`` is 0. (If a row has holes, V_{k+1} is the value of
    the next valid step, as in ``gae``.)
    """
    advantages, _ = gae(step_rewards, step_values, step_mask, gamma=gamma, lam=0.0)
    return advantages


@torch.no_grad()
def batch_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` of the masked entries of ``x`` pooled, except that fewer than two entries, or entries all
    equal, give exactly 0, as a group does in ``scoped_whiten``."""
    keep = mask.bool()
    values = x[keep]
    if values.numel() < 2 or bool(values.amin() == values.amax()):
        return torch.zeros_like(x)
    return masked_whiten(x, keep, eps=eps)


@torch.no_grad()
def scoped_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    scope: str,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Standardise the masked entries of ``x`` ``[B, N]`` (tokens or steps) over a scope.

        batch:  out = (x − μ) / sqrt(σ² + eps)          μ, σ² over every masked entry (``batch_whiten``)
        group:  out = (x − μ_g) / sqrt(σ²_g + eps)      μ_g, σ²_g over the masked entries of the rows of
                                                        group g (``group_ids`` [B], one label per row)
        off:    out = x

    Variances are unbiased, Σ(x − μ)² / (n − 1); a group (or batch) with a single entry has σ² = 0. One
    whose entries are all equal gets exactly 0 (no signal, and no rounding residue divided by √eps).
    ``out`` is 0 where ``mask`` is 0.
    """
    keep = mask.bool()
    if scope == "off":
        return masked_fill_zero(x, keep)
    if scope == "batch":
        return batch_whiten(x, keep, eps)
    if scope != "group":
        raise ValueError(f"unknown whitening scope {scope!r}; valid scopes: {', '.join(WHITEN_SCOPES)}")
    if group_ids.shape != x.shape[:1]:
        raise ValueError(f"scoped_whiten: group_ids must be [B] = {tuple(x.shape[:1])}, got {tuple(group_ids.shape)}")
    x = masked_fill_zero(x, keep)
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0

    def per_group(rows: torch.Tensor, reduce: str = "sum", start: float = 0.0) -> torch.Tensor:
        return torch.full((groups,), start, dtype=x.dtype, device=x.device).scatter_reduce_(0, index, rows, reduce)

    n = per_group(keep.sum(-1).to(x.dtype))
    mean = per_group(x.sum(-1)) / n.clamp_min(1)
    centered = masked_fill_zero(x - mean[index, None], keep)
    var = per_group(centered.square().sum(-1)) / (n - 1).clamp_min(1)
    out = centered * torch.rsqrt(var[index, None] + eps)
    inf = float("inf")
    low = per_group(torch.where(keep, x, inf).amin(-1), "amin", inf)
    high = per_group(torch.where(keep, x, -inf).amax(-1), "amax", -inf)
    flat = (low == high)[index, None]
    return masked_fill_zero(torch.where(flat, torch.zeros_like(out), out), keep)
