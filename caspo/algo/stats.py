"""Masked statistics and loss aggregation over padded ``[B, T]`` tensors.

``mask`` is 0/1 (float or bool). Padded positions may hold anything, NaN and inf
included, so values are selected with ``torch.where`` rather than multiplied by
the mask (``0 * nan = nan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_fill_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, exactly 0 elsewhere (junk in padding never leaks)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``Σ m·x`` over ``dim`` (all dims when None)."""
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over masked entries.

        mmean(x) = Σ m·x / Σ m

    Reduces over ``dim`` (all dims when None). An empty selection gives 0.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries: ``Σ m(x − μ)² / (N − 1)`` (``/ N`` when biased).

    Raises ValueError when the mask selects no entry, or a single entry with ``unbiased``.
    """
    n = int(mask.bool().sum())
    if n == 0:
        raise ValueError("masked_var: the mask selects no entry")
    if unbiased and n == 1:
        raise ValueError("masked_var: the mask selects a single entry; the unbiased variance is undefined")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Standardise the masked entries of ``x`` together (all rows pooled).

        out = (x − μ) / sqrt(σ² + eps)    where m = 1, 0 elsewhere

    μ and σ² are the masked mean and (unbiased by default) variance.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    return masked_fill_zero((x - mean) * torch.rsqrt(var + eps), mask)


@dataclass(frozen=True)
class Counts:
    """A mask's counts, from which each mode's normaliser follows (``normaliser``):

        token-mean               N = Σ m
        seq-mean-*               B' = number of rows with Σ_t m > 0
        seq-mean-token-sum-norm  B'·norm_len  (norm_len defaults to T)

    Each count adds up over disjoint sets of rows, so a minibatch's counts are the sum of its
    micro-batches' (or ranks'). One ``Counts`` of the whole minibatch, passed to every micro-batch as
    ``aggregate``'s ``denom``, serves terms that reduce by different modes (a loss and its KL term).
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    norm_len: int

    @classmethod
    def of(cls, mask: torch.Tensor, norm_len: int | None = None) -> "Counts":
        keep = mask.bool()
        return cls(keep.sum(), keep.any(dim=-1).sum(), keep.shape[-1] if norm_len is None else norm_len)

    def normaliser(self, mode: str) -> torch.Tensor | None:
        """What ``aggregate`` divides by in ``mode`` (None for ``token-sum``)."""
        _check_mode(mode)
        if mode == "token-sum":
            return None
        if mode == "token-mean":
            return self.tokens
        return self.rows * self.norm_len if mode == "seq-mean-token-sum-norm" else self.rows


def aggregate_denom(mask: torch.Tensor, mode: str, norm_len: int | None = None) -> torch.Tensor | None:
    """The normaliser ``aggregate`` divides by for this mask (None for ``token-sum``): ``Counts``'."""
    return Counts.of(mask, norm_len).normaliser(mode)


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm_len: int | None = None,
    denom: "Counts | torch.Tensor | float | None" = None,
) -> torch.Tensor:
    """Reduce a per-token ``[B, T]`` loss to a scalar.

        token-mean               Σ m·x / N                         N  = Σ m
        token-sum                Σ m·x
        seq-mean-token-sum       (1/B') Σ_i Σ_t m·x                B' = non-empty rows
        seq-mean-token-mean      (1/B') Σ_i (Σ_t m·x / L_i)        L_i = Σ_t m_i
        seq-mean-token-sum-norm  Σ m·x / (B'·norm_len)             norm_len defaults to T

    ``denom``, when given, replaces the normaliser computed from this tensor:
    N for token-mean, B' for seq-mean-token-sum and seq-mean-token-mean (each
    row keeps its own 1/L_i), B'·norm_len for seq-mean-token-sum-norm. Pass the
    count of the whole minibatch (``aggregate_denom(full_mask, mode)``, summed
    over data-parallel ranks) to every micro-batch; then
    ``Σ_k aggregate(x_k, m_k, mode, denom=D) == aggregate(x, m, mode)``. A
    ``Counts`` gives the normaliser of ``mode``. token-sum has no normaliser and
    rejects a number as ``denom``. A zero normaliser (nothing selected) gives 0.
    """
    _check_mode(mode)
    if isinstance(denom, Counts):
        denom = denom.normaliser(mode)
    keep = mask.bool()
    x = masked_fill_zero(x, keep)

    if mode == "token-sum":
        if denom is not None:
            raise ValueError("aggregate: 'token-sum' has no normaliser, so denom must be None")
        return x.sum()

    if mode == "seq-mean-token-mean":
        lengths = keep.sum(dim=-1).clamp_min(1).to(x.dtype)
        total = (x.sum(dim=-1) / lengths).sum()
    else:
        total = x.sum()

    if denom is None:
        denom = aggregate_denom(keep, mode, norm_len)
    denom = torch.as_tensor(denom, dtype=x.dtype, device=x.device)
    # Nothing selected means total == 0; divide by 1 to return 0, not nan.
    return total / torch.where(denom > 0, denom, torch.ones_like(denom))


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
