"""The nucleus search's reads of the rows on CUDA, other than its passes (`mass_above.narrow`).

For scaled logits x = logits · scale [B, V] (float32; each kernel multiplies as it reads, so no scaled
copy is written) the search needs, per row (docs/engine/nucleus.md):

    chunk_maxima     max of x over each chunk of `chunk` entries              one read of x
    exp_and_mass     e_i = exp(x_i - max_k x_k), and each part's integer mass
                     sum_i floor(e_i 2^shift) (int64, exact in any order); and
                     the float32 screen of the search's first pass             one read of x, one write of e
    threshold_logit  min {x_i : e_i >= t}, t a float32 bit pattern per row    one read of x and e
    collect          the entries of e inside an interval [lo, hi] of bit patterns,
                     at most `capacity` a part, with their indices, and each part's
                     mass above the interval, sum_{e_i > hi} floor(e_i 2^shift) one read of e

As torch operations these were about ten reads and writes of [B, V] around the passes (the row
max, the difference, the exponentials, a mass pass, the chunk maxima, a mask, a select and a
min), most of the sampler's time when every row's nucleus is found among its likeliest tokens.

The exponentials are libdevice's `exp`, which is CUDA's `expf` (triton's own `tl.exp` is a faster
approximation), and numpy's exp under triton's CPU interpreter. Each kernel's grid is (rows, parts
of SPAN entries); the parts' results are reduced by torch or by the search's per-row kernels
(`nucleus_resolve`).

Two habits of the loops, counted in the SASS triton builds for sm_90 with the vocabulary specialised as
divisible by 16, as the JIT does for Qwen's 151,936 (a loop iteration of `exp_and_mass` with the first pass's
screen: 367 instructions without them, 298 with both):
- the vocabulary bound is compared as `lanes < vocab - offset`, in 32 bits: written `index < vocab`,
  the compiler widens the compare to 64 bits;
- a float32 screen adds e · [e >= level], a compare that gives 1.0 or 0.0 and one FMA, where a select
  and an add cost one more instruction an entry and level. The sums are the same: e · 1 and e · 0 are exact.
`exp_and_mass` keeps its screen as an [entries, levels] tile, where the passes (`mass_above`) keep
[levels, entries]: that way round its loop was 273 instructions without a barrier, but the kernel ran about
5% slower on an H100, 6 us a call at 256 rows (benchmarks/RESULTS.md, thirty-first series). With only 8
iterations a program, its larger end (each thread reduces every level across the warp) likely outweighs
what the loop saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from caspo.rollout.mass_above import cut_levels

SPAN = 8192  # entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 1024  # entries per loop iteration
WARPS = 4


@triton.jit
def _triton_exp(x):
    return tl.exp(x)


INTERPRETED = not isinstance(_triton_exp, JITFunction)  # triton's CPU interpreter (tests)
if INTERPRETED:  # libdevice has no interpreter; there tl.exp is numpy's exp
    _accurate_exp = _triton_exp
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _accurate_exp(x):
        return libdevice.exp(x)


@triton.jit
def _chunk_maxima_kernel(X, Maxima, vocab, chunks, stride_row, x_scale,
                         CHUNK: tl.constexpr, PER_PART: tl.constexpr, ROWS: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    for first in range(0, PER_PART, ROWS):  # ROWS chunks at a time, as a [ROWS, CHUNK] tile
        chunk = part * PER_PART + first + tl.arange(0, ROWS)
        index = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        x = tl.load(X + row * stride_row + index, mask=index < vocab, other=float("-inf")) * x_scale
        tl.store(Maxima + row * chunks + chunk, tl.max(x, axis=1), mask=chunk < chunks)


@triton.jit
def _exp_and_mass_kernel(X, RowMax, E, Partial, ScreenSums, vocab, stride_row, x_scale, scale,
                         SPAN: tl.constexpr, BLOCK: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
                         M: tl.constexpr, LEVELS: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    top = tl.load(RowMax + row)
    total = tl.zeros([BLOCK], dtype=tl.int64)
    levels = cut_levels(tl.full([], LO, tl.int64), tl.full([], HI, tl.int64), tl.arange(0, LEVELS), M)
    screened = tl.zeros([BLOCK, LEVELS], dtype=tl.float32)
    lanes = tl.arange(0, BLOCK)
    for offset in range(part * SPAN, part * SPAN + SPAN, BLOCK):
        index = offset + lanes
        inside = lanes < vocab - offset
        e = _accurate_exp(tl.load(X + row * stride_row + index, mask=inside, other=float("-inf")) * x_scale - top)
        tl.store(E + row * stride_row + index, e, mask=inside)
        total += (e * scale).to(tl.int64)  # exact scaling by a power of two, then truncation
        if M > 0:  # the first pass's float32 screen, whose levels are every row's (`mass_above._screen_kernel`)
            screened += e[:, None] * (e[:, None] >= levels[None, :]).to(tl.float32)
    tl.store(Partial + row * tl.num_programs(1) + part, tl.sum(total, axis=0))
    if M > 0:
        tl.store(ScreenSums + (row * tl.num_programs(1) + part) * LEVELS + tl.arange(0, LEVELS),
                 tl.sum(screened.to(tl.float64), axis=0))


@triton.jit
def _threshold_logit_kernel(X, E, Bits, Skip, Partial, vocab, stride_row, x_scale,
                            SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    least = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    if tl.load(Skip + row) == 0:  # a row whose threshold is known is not read
        t = tl.load(Bits + row).to(tl.int32).to(tl.float32, bitcast=True)
        lanes = tl.arange(0, BLOCK)
        for offset in range(part * SPAN, part * SPAN + SPAN, BLOCK):
            index = offset + lanes
            inside = lanes < vocab - offset
            e = tl.load(E + row * stride_row + index, mask=inside, other=0.0)
            x = tl.load(X + row * stride_row + index, mask=inside, other=float("inf")) * x_scale
            least = tl.minimum(least, tl.where(e >= t, x, float("inf")))
    tl.store(Partial + row * tl.num_programs(1) + part, tl.min(least, axis=0))


@triton.jit
def _collect_kernel(E, Lo, Hi, Skip, Values, Index, Counts, Above, vocab, stride_row, scale,
                    CAPACITY: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    slot = row * tl.num_programs(1) + part
    above = tl.zeros([BLOCK], dtype=tl.int64)
    if tl.load(Skip + row) == 0:  # a resolved row is not read: it counts nothing
        lo = tl.load(Lo + row).to(tl.int32).to(tl.float32, bitcast=True)
        hi = tl.load(Hi + row).to(tl.int32).to(tl.float32, bitcast=True)
        lanes = tl.arange(0, BLOCK)
        for offset in range(part * SPAN, part * SPAN + SPAN, BLOCK):
            index = offset + lanes
            e = tl.load(E + row * stride_row + index, mask=lanes < vocab - offset, other=0.0)
            above += tl.where(e > hi, (e * scale).to(tl.int64), 0)
            inside = (e >= lo) & (e <= hi)
            # each entry inside takes the next slot of its part's counter (Counts starts at 0): a few atomics
            # where a scan over the block cost more than the read (178 against 74 µs a collect, H100)
            position = tl.atomic_add(Counts + slot + tl.zeros([BLOCK], dtype=tl.int32), 1, mask=inside,
                                     sem="relaxed")
            keep = inside & (position < CAPACITY)
            tl.store(Values + slot * CAPACITY + position, e, mask=keep)
            tl.store(Index + slot * CAPACITY + position, index, mask=keep)
    tl.store(Above + slot, tl.sum(above, axis=0))


def _check(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"the nucleus kernels need contiguous [B, V] float32 logits, got {x.dtype} {tuple(x.shape)}")


def _parts(vocab: int) -> int:
    return triton.cdiv(vocab, SPAN)


def chunk_maxima(x: torch.Tensor, chunk: int, scale: float = 1.0) -> torch.Tensor:
    """[B, ceil(V / chunk)]: the max of x · scale over each row's chunks of `chunk` entries (a power of two
    dividing SPAN)."""
    _check(x)
    rows, vocab = x.shape
    if SPAN % chunk or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two dividing {SPAN}, got {chunk}")
    chunks = triton.cdiv(vocab, chunk)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    _chunk_maxima_kernel[(rows, _parts(vocab))](x, maxima, vocab, chunks, x.stride(0), scale, CHUNK=chunk,
                                                PER_PART=SPAN // chunk, ROWS=max(1, BLOCK // chunk),
                                                num_warps=WARPS)
    return maxima


def exp_and_mass(x: torch.Tensor, row_max: torch.Tensor, shift: int, scale: float = 1.0,
                 first_pass: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """(e [B, V], masses [B, parts] int64): e = exp(x · scale - row_max[:, None]) and, for each part of SPAN
    entries, sum_i floor(e_i 2^shift) (a row's total mass is their sum).

    first_pass (lo, hi, m): also the float32 screen of the search's first pass, whose m levels every row cuts
    from the same interval [lo, hi]: a third result [B, parts, levels] (float64) for
    `mass_above.screened_narrow(sums=)`, in place of another read of e. Each lane sums SPAN / BLOCK entries,
    inside the screen's rounding bound."""
    _check(x)
    rows, vocab = x.shape
    e = torch.empty_like(x)
    partial = torch.empty(rows, _parts(vocab), dtype=torch.int64, device=x.device)
    lo, hi, m = first_pass or (0, 0, 0)
    width = max(2, triton.next_power_of_2(m))
    sums = torch.empty(rows, _parts(vocab), width, dtype=torch.float64, device=x.device) if m else partial
    _exp_and_mass_kernel[(rows, _parts(vocab))](x, row_max.float().contiguous(), e, partial, sums, vocab, x.stride(0),
                                                scale, 2.0 ** shift, SPAN=SPAN, BLOCK=BLOCK, LO=lo, HI=hi, M=m,
                                                LEVELS=width, num_warps=WARPS)
    return (e, partial, sums) if m else (e, partial)


def threshold_logit(x: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, skip: torch.Tensor,
                    scale: float = 1.0) -> torch.Tensor:
    """[B]: min {x_i · scale : e_i >= t} with t the float32 of bit pattern `bits` [B] (int64); +inf for the
    rows `skip` [B] (int8) marks, which are not read."""
    _check(x)
    rows, vocab = x.shape
    _check(e)
    if e.shape != x.shape:
        raise ValueError(f"threshold_logit needs e of x's shape {tuple(x.shape)}, got {tuple(e.shape)}")
    partial = torch.empty(rows, _parts(vocab), dtype=torch.float32, device=x.device)
    _threshold_logit_kernel[(rows, _parts(vocab))](x, e, bits, skip, partial, vocab, x.stride(0), scale,
                                                   SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    return partial.amin(1)


def collect(e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, skip: torch.Tensor, shift: int, capacity: int
            ) -> tuple[torch.Tensor, ...]:
    """The entries of each row of e [B, V] whose bit patterns lie in [lo, hi] (int64 [B]), part by part of SPAN
    entries: (values [B, parts, capacity] float32, their indices int32, counts [B, parts] int32, above [B, parts]
    int64).
    A part keeps `capacity` of its entries, in no set order, and counts them all (a count above `capacity`
    means some were left out); slots past a part's count hold garbage. What the search reads of them (the
    threshold among their values, the least logit at or above it) does not depend on the order. `above` is each part's
    mass sum floor(e_i 2^shift) over e_i > hi. Rows that `skip` [B] (int8) marks are not read: count 0, above 0."""
    _check(e)
    rows, vocab = e.shape
    parts = _parts(vocab)
    values = torch.empty(rows, parts, capacity, dtype=torch.float32, device=e.device)
    index = torch.empty(rows, parts, capacity, dtype=torch.int32, device=e.device)
    counts = torch.zeros(rows, parts, dtype=torch.int32, device=e.device)
    above = torch.empty(rows, parts, dtype=torch.int64, device=e.device)
    _collect_kernel[(rows, parts)](e, lo, hi, skip, values, index, counts, above, vocab, e.stride(0),
                                   2.0 ** shift, CAPACITY=capacity, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    return values, index, counts, above
