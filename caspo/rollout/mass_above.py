"""The mass at or above m levels per row, in one read of the row: a pass of the nucleus search on CUDA.

    W[b, j] = sum of w_i over {i : e[b, i] >= levels[b, j]},   w_i = floor(e[b, i] · 2^shift)  (int64)

`sampling.nucleus_threshold` narrows a row's threshold with a few such passes (the search and its
proof: docs/engine/nucleus.md). Written as torch reductions, each pass reads the [B, vocab] row set
once per level; this kernel reads it once for all m levels: grid (rows, parts of the vocabulary),
each program accumulating m int64 sums over its part, then a sum over parts. A program keeps a
[BLOCK, m] tile of sums in registers and reduces it across threads once, at the end: reducing every
iteration made the cross-thread shuffles, not the compare-adds, the cost of a pass. Integer sums
are exact, so the result equals the torch computation bit for bit, whatever the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPAN = 8192  # vocabulary entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 256  # entries per loop iteration, each thread holding BLOCK / (32 WARPS) rows of the m sums
WARPS = 4


@triton.jit
def _mass_above_kernel(E, Levels, Skip, Partial, vocab, stride_row, scale,
                       LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    slots = tl.arange(0, LEVELS)
    levels = tl.load(Levels + row * LEVELS + slots)  # padded with +inf: those sums stay 0
    acc = tl.zeros([BLOCK, LEVELS], dtype=tl.int64)
    if tl.load(Skip + row) == 0:  # a skipped row is not read: its sums stay 0
        for offset in range(0, SPAN, BLOCK):
            index = part * SPAN + offset + tl.arange(0, BLOCK)
            e = tl.load(E + row * stride_row + index, mask=index < vocab, other=0.0)
            w = (e * scale).to(tl.int64)  # exact scaling by a power of two, then truncation, as torch does
            acc += tl.where(e[:, None] >= levels[None, :], w[:, None], 0)
    tl.store(Partial + (row * tl.num_programs(1) + part) * LEVELS + slots, tl.sum(acc, axis=0))


def mass_above(e: torch.Tensor, levels: torch.Tensor, shift: int, skip: torch.Tensor | None = None) -> torch.Tensor:
    """W [B, m] int64 for e [B, vocab] float32 (last dim contiguous) and levels [B, m] float32; rows that
    `skip` [B] (bool) marks are not read, and get 0."""
    if e.dtype != torch.float32 or levels.dtype != torch.float32:
        raise ValueError(f"mass_above needs float32 e and levels, got {e.dtype} and {levels.dtype}")
    if e.stride(-1) != 1:
        raise ValueError("mass_above needs e with a contiguous last dimension")
    rows, vocab = e.shape
    m = levels.shape[1]
    width = max(2, triton.next_power_of_2(m))
    padded = levels.new_full((rows, width), float("inf"))
    padded[:, :m] = levels
    parts = triton.cdiv(vocab, SPAN)
    partial = torch.empty(rows, parts, width, dtype=torch.int64, device=e.device)
    skip = torch.zeros(rows, dtype=torch.int8, device=e.device) if skip is None else skip.to(torch.int8)
    _mass_above_kernel[(rows, parts)](e, padded, skip, partial, vocab, e.stride(0), 2.0 ** shift,
                                      LEVELS=width, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    return partial.sum(1)[:, :m]
