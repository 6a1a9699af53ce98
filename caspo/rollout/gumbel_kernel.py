"""The Gumbel-max pick on CUDA in one read of the logits: the sampler's last step, fused.

For logits x [B, V] (float32), inverse temperature r (a float32 number), cut threshold c [B, 1]
and the counter noise U:

    s_i = x_i · r                                   (float32 product, as torch's)
    token = argmax_i (s_i if s_i >= c else -inf) + G_i,   G_i = -log(-log U_i)  (float64, first index on ties)
    log-prob = s_token - logsumexp{s_i : s_i >= c},   untruncated = s_token - logsumexp_i s_i

`sampling.gumbel_pick` computes the same with torch ops, which read and write [B, V] several
times (scaling, noise, argmax and two log-sum-exps: about 0.6 ms per step at B = 256 and
V = 151,936 on an H200). Here grid (rows, parts of the vocabulary): each program hashes the
noise of its part, keeps per-lane running maxima and online sums in registers, reduces them
across threads once at the end and writes one partial per (row, part); a few [B, parts] torch
ops combine the parts. Tokens equal `gumbel_pick`'s: the keys are the same float64 numbers
and ties go to the first index within a lane, a program and across parts. Log-probs agree to
float32 rounding (the sums run in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPAN = 8192  # vocabulary entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 1024  # entries per loop iteration
WARPS = 8


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _online_logsumexp(top, total, s):
    """Fold s into per-lane (max, sum of exp(s - max)); lanes that saw only -inf keep (-inf, 0)."""
    new_top = tl.maximum(top, s)
    anchor = tl.where(new_top == float("-inf"), 0.0, new_top)
    return new_top, total * tl.exp(top - anchor) + tl.exp(s - anchor)


@triton.jit
def _store_logsumexp(top, total, Top, Total):
    """Reduce per-lane (max, sum) to the program's (max, sum of exp(s - max)) across threads."""
    part_top = tl.max(top, 0)
    anchor = tl.where(part_top == float("-inf"), 0.0, part_top)
    tl.store(Top, part_top)
    tl.store(Total, tl.sum(total * tl.exp(top - anchor), 0))


@triton.jit
def _gumbel_pick_kernel(Logits, RowHash, Threshold, inverse_temperature, vocab, stride_row,
                        BestKey, BestIndex, KeptTop, KeptTotal, FullTop, FullTotal,
                        SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    row_hash = tl.load(RowHash + row).to(tl.uint32)
    cut = tl.load(Threshold + row)
    best_key = tl.full([BLOCK], float("-inf"), tl.float64)
    best_index = tl.zeros([BLOCK], tl.int32)
    kept_top = tl.full([BLOCK], float("-inf"), tl.float32)
    kept_total = tl.zeros([BLOCK], tl.float32)
    full_top = tl.full([BLOCK], float("-inf"), tl.float32)
    full_total = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, SPAN, BLOCK):
        index = part * SPAN + offset + tl.arange(0, BLOCK)
        x = tl.load(Logits + row * stride_row + index, mask=index < vocab, other=float("-inf"))
        s = x * inverse_temperature
        kept = tl.where(s >= cut, s, float("-inf"))
        h = _fmix32(row_hash ^ (index.to(tl.uint32) * 0x165667B1 + 0x61C88647))  # uint32 arithmetic wraps
        u = ((h >> 8).to(tl.float64) + 0.5) * (1.0 / (1 << 24))
        key = kept.to(tl.float64) - tl.log(-tl.log(u))
        better = key > best_key  # strict: a lane keeps the first index of its maximum
        best_key = tl.where(better, key, best_key)
        best_index = tl.where(better, index, best_index)
        kept_top, kept_total = _online_logsumexp(kept_top, kept_total, kept)
        full_top, full_total = _online_logsumexp(full_top, full_total, s)
    out = row * tl.num_programs(1) + part
    top_key = tl.max(best_key, 0)
    tl.store(BestKey + out, top_key)
    tl.store(BestIndex + out, tl.min(tl.where(best_key == top_key, best_index, vocab), 0))
    _store_logsumexp(kept_top, kept_total, KeptTop + out, KeptTotal + out)
    _store_logsumexp(full_top, full_total, FullTop + out, FullTotal + out)


def _combine_logsumexp(top: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """logsumexp [B] from per-part (max, sum of exp(s - max)) [B, parts]."""
    row_top = top.amax(-1, keepdim=True)
    return (row_top + torch.log((total * torch.exp(top - row_top)).sum(-1, keepdim=True)))[:, 0]


def fused_gumbel_pick(logits: torch.Tensor, inverse_temperature: float, threshold: torch.Tensor,
                      row_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B], untruncated log-probs [B]) for float32 logits [B, V] (last dim contiguous).

    inverse_temperature: `sampling.inverse_temperature(T)`; threshold [B, 1] float32 applies to
    logits · inverse_temperature; row_hash [B] int64 is `sampling.noise_row_hash(seeds, positions)`.
    """
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"fused_gumbel_pick needs float32 logits with a contiguous last dimension, got {logits.dtype}")
    rows, vocab = logits.shape
    parts = triton.cdiv(vocab, SPAN)
    best_key = torch.empty(rows, parts, dtype=torch.float64, device=logits.device)
    best_index = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    tops_totals = [torch.empty(rows, parts, dtype=torch.float32, device=logits.device) for _ in range(4)]
    _gumbel_pick_kernel[(rows, parts)](logits, row_hash, threshold.float().contiguous(), inverse_temperature, vocab,
                                       logits.stride(0), best_key, best_index, *tops_totals,
                                       SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    tokens = best_index.gather(-1, best_key.argmax(-1, keepdim=True))[:, 0].long()  # first part on ties
    picked = logits.gather(-1, tokens[:, None])[:, 0] * inverse_temperature
    kept_top, kept_total, full_top, full_total = tops_totals
    return (tokens, picked - _combine_logsumexp(kept_top, kept_total),
            picked - _combine_logsumexp(full_top, full_total))
