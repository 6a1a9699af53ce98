"""Log-probabilities and entropies of tokens from ``[B, T, V]`` logits, in row chunks.

A float32 log-softmax over a 150k vocabulary costs 600 KB per token, so a full
``[B·T, V]`` copy (and the one autograd would keep for backward) is never built:
the forward and the backward each walk the rows ``chunk_size`` at a time, upcast
only the current chunk, and keep just one log-normaliser per row in between.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 are upcast to fp32; fp64 stays fp64.
    return torch.promote_types(dtype, torch.float32)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """logp_i = z_{i,a_i} − logsumexp_v z_{i,v},  z = logits / τ.

    Backward:  ∂logp_i/∂logits_{i,v} = ([v = a_i] − softmax(z_i)_v) / τ.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size):
        dtype = _compute_dtype(logits.dtype)
        logp = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(logp)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = logits[rows].to(dtype) / temperature
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(-1, tokens[rows, None]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp):
        logits, tokens, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            g = grad_logp[rows, None].to(lse.dtype)
            probs = torch.exp(logits[rows].to(lse.dtype) / temperature - lse[rows, None])
            grad = (-probs * g).scatter_add_(-1, tokens[rows, None], g)
            grad_logits[rows] = (grad / temperature).to(logits.dtype)
        return grad_logits, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Selective log-softmax: log π(tokens) under softmax(logits / temperature).

        logp[b, t] = logits[b, t, a] / τ − logsumexp_v(logits[b, t, v] / τ),   a = tokens[b, t]

    ``logits`` ``[B, T, V]`` (any float dtype; bf16/fp16 are upcast to fp32 one chunk
    of ``chunk_size`` rows at a time), ``tokens`` ``[B, T]`` valid ids. Returns
    ``[B, T]`` in fp32 (fp64 for fp64 logits). Differentiable with respect to
    ``logits``; the backward is chunked too.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on [B, T]")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_tokens = tokens.reshape(-1).long()
    logp = _SelectiveLogSoftmax.apply(flat_logits, flat_tokens, float(temperature), int(chunk_size))
    return logp.view(tokens.shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position, ``[B, T]``, no gradient.

        H[b, t] = −Σ_v p_v · log p_v,   p = softmax(logits[b, t] / τ)

    Computed ``chunk_size`` rows at a time in fp32 (fp64 for fp64 logits).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    entropy = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logp = torch.log_softmax(flat[rows].to(dtype) / temperature, dim=-1)
        plogp = logp.exp() * logp
        # Tokens with p = 0 (e.g. -inf logits) contribute 0, not 0·(−inf) = nan.
        entropy[rows] = -torch.where(logp.isneginf(), torch.zeros_like(plogp), plogp).sum(-1)
    return entropy.view(logits.shape[:-1])
