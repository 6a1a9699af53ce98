"""The mass at or above m levels per row, in one read of the row: a pass of the nucleus search on CUDA.

    W[b, j] = sum of w_i over {i : e[b, i] >= levels[b, j]},   w_i = floor(e[b, i] · 2^shift)  (int64)

`sampling.nucleus_threshold` narrows a row's threshold with a few such passes. Written as torch
reductions, each pass reads the [B, vocab] row set once per level; this kernel reads it once
for all m levels: grid (rows, parts of the vocabulary), each program accumulating m int64
sums over its part, then a sum over parts. A program keeps a [BLOCK, m] tile of sums in
registers and reduces it across threads once, at the end: reducing every iteration made the
cross-thread shuffles, not the compare-adds, the cost of a pass. Integer sums are exact, so
the result equals the torch computation bit for bit, whatever the order.

Once the search has narrowed a row's threshold to an interval [lo, hi], only the entries inside
it tell the levels apart: for every level c >= lo,

    W(c) = A + sum of w_i over {i : lo <= e_i <= hi, e_i >= c},   A = sum of w_i over {e_i > hi}.

`compact` copies those candidates of each row (in any order: the sums do not depend on it) into
a small buffer and computes A, so the remaining passes read the buffer instead of the row. A row
with more candidates than the buffer holds keeps reading its whole row, so the result is the
same either way; nothing on the host depends on which rows overflowed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SPAN = 8192  # vocabulary entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 256  # entries per loop iteration, each thread holding BLOCK / (32 WARPS) rows of the m sums
WARPS = 4


class Candidates(NamedTuple):
    """The entries of each row inside its interval, padded with 0 (below every level), and the mass above it."""
    values: torch.Tensor  # [B, capacity] float32
    count: torch.Tensor  # [B] int32: candidates found; the row overflowed when it exceeds capacity
    above: torch.Tensor  # [B] int64: A, the mass above the interval


@triton.jit
def _accumulate(acc, Values, start, stop, levels, scale, BLOCK: tl.constexpr):
    for offset in range(start, stop, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        e = tl.load(Values + index, mask=index < stop, other=0.0)
        w = (e * scale).to(tl.int64)  # exact scaling by a power of two, then truncation, as torch does
        acc += tl.where(e[:, None] >= levels[None, :], w[:, None], 0)
    return acc


@triton.jit
def _mass_above_kernel(E, Levels, Partial, vocab, stride_row, scale, Values, Count, capacity,
                       LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr, COMPACT: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    slots = tl.arange(0, LEVELS)
    levels = tl.load(Levels + row * LEVELS + slots)  # padded with +inf: those sums stay 0
    acc = tl.zeros([BLOCK, LEVELS], dtype=tl.int64)
    start = part * SPAN
    stop = tl.minimum(start + SPAN, vocab)
    if COMPACT:
        if tl.load(Count + row) <= capacity:  # the row's candidates, all read by part 0
            if part == 0:
                acc = _accumulate(acc, Values + row * capacity, 0, capacity, levels, scale, BLOCK)
            stop = start  # and the whole row by no one
    acc = _accumulate(acc, E + row * stride_row, start, stop, levels, scale, BLOCK)
    tl.store(Partial + (row * tl.num_programs(1) + part) * LEVELS + slots, tl.sum(acc, axis=0))


@triton.jit
def _compact_kernel(E, Values, Count, Above, vocab, stride_row, scale, lo, hi, capacity,
                    SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    low = tl.load(lo + row)
    high = tl.load(hi + row)
    above = tl.zeros([BLOCK], dtype=tl.int64)
    for offset in range(0, SPAN, BLOCK):
        index = part * SPAN + offset + tl.arange(0, BLOCK)
        e = tl.load(E + row * stride_row + index, mask=index < vocab, other=0.0)
        above += tl.where(e > high, (e * scale).to(tl.int64), 0)
        inside = (e >= low) & (e <= high)
        found = tl.sum(inside.to(tl.int32), 0)
        if found > 0:
            slot = tl.atomic_add(Count + row, found) + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(Values + row * capacity + slot, e, mask=inside & (slot < capacity))
    tl.atomic_add(Above + row, tl.sum(above, 0))


def compact(e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, shift: int, capacity: int) -> Candidates:
    """The candidates of each row in [lo, hi] (float32 [B, 1] bounds) and the mass above hi."""
    rows, vocab = e.shape
    values = e.new_zeros(rows, capacity)
    count = torch.zeros(rows, dtype=torch.int32, device=e.device)
    above = torch.zeros(rows, dtype=torch.int64, device=e.device)
    _compact_kernel[(rows, triton.cdiv(vocab, SPAN))](e, values, count, above, vocab, e.stride(0), 2.0 ** shift,
                                                      lo.contiguous(), hi.contiguous(), capacity,
                                                      SPAN=SPAN, BLOCK=1024, num_warps=WARPS)
    return Candidates(values, count, above)


def mass_above(e: torch.Tensor, levels: torch.Tensor, shift: int, candidates: Candidates | None = None) -> torch.Tensor:
    """W [B, m] int64 for e [B, vocab] float32 (last dim contiguous) and levels [B, m] float32.

    With `candidates` (from `compact` on an interval holding every level), rows that fit read
    their candidates instead of the row.
    """
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
    values, count, capacity = e, e, 0  # unused placeholders without candidates
    if candidates is not None:
        values, count, capacity = candidates.values, candidates.count, candidates.values.shape[1]
    _mass_above_kernel[(rows, parts)](e, padded, partial, vocab, e.stride(0), 2.0 ** shift, values, count, capacity,
                                      LEVELS=width, SPAN=SPAN, BLOCK=BLOCK, COMPACT=candidates is not None,
                                      num_warps=WARPS)
    total = partial.sum(1)[:, :m]
    if candidates is None:
        return total
    return total + torch.where(candidates.count <= capacity, candidates.above, 0)[:, None]
