"""The mass at or above m levels per row, in one read of the row: a pass of the nucleus search on CUDA.

    W[b, j] = sum of w_i over {i : e[b, i] >= levels[b, j]},   w_i = floor(e[b, i] · 2^shift)  (int64)

`sampling.nucleus_threshold` narrows a row's threshold with a few such passes (the search and its
proof: docs/engine/nucleus.md). Written as torch reductions, each pass reads the [B, vocab] row set
once per level; this kernel reads it once for all m levels: grid (rows, parts of the vocabulary),
each program accumulating m int64 sums over its part, then a sum over parts. A program keeps an
[m, BLOCK] tile of sums in registers and reduces it across threads once, at the end: reducing every
iteration made the cross-thread shuffles, not the compare-adds, the cost of a pass. Integer sums
are exact, so the result equals the torch computation bit for bit, whatever the order.

The tile is [levels, entries] over the row read as a [1, BLOCK] tile, so each thread holds every level of
its own entries. As [entries, levels] each thread held one level of many entries, and every entry crossed
shared memory to the threads of its levels, behind two barriers a loop iteration (four in the int64 pass).
In the SASS triton builds for sm_90 (the vocabulary divisible by 16, as the JIT specialises Qwen's), a loop
iteration of the float32 screen went from 90 instructions to 77 and of the int64 pass from 117 to 98, with
no barrier left; on an H100 the screen of a flat row set (256 rows, std 1) from 71 to 63 us a call
(benchmarks/RESULTS.md, thirty-first series).

`narrow` is a whole pass in two kernels: the levels cut from each row's interval [lo, hi] of bit
patterns inside the sum kernel, then one program per row that adds the parts' sums, counts the
levels reached and narrows the interval in place. As torch operations a pass was about twenty small
kernels, most of a step's launches at top-p < 1.

`screened_narrow` is the same pass, decided first by float32 sums of e, with a bound on their rounding:
the int64 compare-adds, not the read of the row, are what a pass costs. A row whose every level's mass
is surely above or surely below the target narrows on the float32 sums, to the interval the int64 sums
would give; a row with a level too close to call (within SCREEN_BOUND of the target) takes the int64
pass, which reads only such rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPAN = 8192  # vocabulary entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 256  # entries per loop iteration, each thread holding the m sums of BLOCK / (32 WARPS) of them
WARPS = 4
# entries per loop iteration of the float32 screen: with the [m, BLOCK] tile, 512 took 63 us a pass at 256 flat rows
# on an H100, against 69 at 256 and 84 at 1,024 (the int64 sums' best is 256)
SCREEN_BLOCK = 512
# A float32 sum of n >= 0 terms, added one by one, is within (n - 1) u / (1 - (n - 1) u) of the exact sum
# (u = 2^-24). Each lane of the screening kernel adds SPAN / SCREEN_BLOCK = 16 entries (at most 32 for the
# bound below), and the lanes and parts are added in float64: 2^-18 bounds the relative error with room for
# the float64 roundings.
SCREEN_BOUND = 2.0 ** -18


@triton.jit
def _level_sums(E, start, stop, levels, vocab, scale, LEVELS: tl.constexpr, BLOCK: tl.constexpr):
    """The m int64 sums of w over e >= each level, for the entries [start, stop) of a row E (a pointer)."""
    acc = tl.zeros([LEVELS, BLOCK], dtype=tl.int64)
    lanes = tl.arange(0, BLOCK)[None, :]
    for offset in range(start, stop, BLOCK):
        e = tl.load(E + offset + lanes, mask=lanes < vocab - offset, other=0.0)  # in 32 bits (nucleus_reads)
        w = (e * scale).to(tl.int64)  # exact scaling by a power of two, then truncation, as torch does
        acc += tl.where(e >= levels[:, None], w, 0)
    return tl.sum(acc, axis=1)


@triton.jit
def cut_levels(lo, hi, slots, m):
    """The m levels cut from the interval [lo, hi] of float32 bit patterns; the padding slots get +inf."""
    cuts = lo + (hi - lo + 1) * (slots + 1).to(tl.int64) // (m + 1)
    return tl.where(slots < m, cuts.to(tl.int32).to(tl.float32, bitcast=True), float("inf"))


@triton.jit
def _narrowed(lo, hi, count, m):
    """The piece of [lo, hi] that holds the threshold, c of its m levels reached."""
    width = hi - lo + 1
    return lo + width * count // (m + 1), lo + width * (count + 1) // (m + 1) - 1


@triton.jit
def _store_part_sums(E, Skip, Partial, levels, vocab, stride_row, scale,
                     LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """This program's part of the row: the m int64 sums of w over e >= each level, stored to Partial."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    sums = tl.zeros([LEVELS], dtype=tl.int64)
    if tl.load(Skip + row) == 0:  # a skipped row is not read: its sums stay 0
        sums = _level_sums(E + row * stride_row, part * SPAN, part * SPAN + SPAN, levels, vocab, scale, LEVELS, BLOCK)
    tl.store(Partial + (row * tl.num_programs(1) + part) * LEVELS + tl.arange(0, LEVELS), sums)


@triton.jit
def _mass_above_kernel(E, Levels, Skip, Partial, vocab, stride_row, scale,
                       LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    levels = tl.load(Levels + tl.program_id(0) * LEVELS + tl.arange(0, LEVELS))  # padded with +inf: sums stay 0
    _store_part_sums(E, Skip, Partial, levels, vocab, stride_row, scale, LEVELS, SPAN, BLOCK)


@triton.jit
def _cut_mass_kernel(E, Lo, Hi, Skip, Partial, vocab, stride_row, scale,
                     M: tl.constexpr, LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    levels = cut_levels(tl.load(Lo + row), tl.load(Hi + row), tl.arange(0, LEVELS), M)
    _store_part_sums(E, Skip, Partial, levels, vocab, stride_row, scale, LEVELS, SPAN, BLOCK)


@triton.jit
def _narrow_kernel(Partial, Lo, Hi, Target, Skip, parts,
                   M: tl.constexpr, LEVELS: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, LEVELS)
    index = tl.arange(0, PARTS)
    sums = tl.load(Partial + (row * parts + index[:, None]) * LEVELS + slots[None, :],
                   mask=index[:, None] < parts, other=0)
    reached = (tl.sum(sums, axis=0) >= tl.load(Target + row)) & (slots < M)
    count = tl.sum(reached.to(tl.int64), axis=0)
    if tl.load(Skip + row) == 0:  # a skipped row keeps its interval: resolved (width 1), or screened
        lo, hi = _narrowed(tl.load(Lo + row), tl.load(Hi + row), count, M)
        tl.store(Lo + row, lo)
        tl.store(Hi + row, hi)


@triton.jit
def _screen_kernel(E, Lo, Hi, Skip, Partial, vocab, stride_row,
                   M: tl.constexpr, LEVELS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """This program's part of the row: the m sums of e >= each level cut from [lo, hi], float32 in each lane
    (SPAN / SCREEN_BLOCK entries), float64 across lanes, stored to Partial."""
    row, part = tl.program_id(0), tl.program_id(1)
    sums = tl.zeros([LEVELS], dtype=tl.float64)
    if tl.load(Skip + row) == 0:
        levels = cut_levels(tl.load(Lo + row), tl.load(Hi + row), tl.arange(0, LEVELS), M)
        acc = tl.zeros([LEVELS, BLOCK], dtype=tl.float32)
        lanes = tl.arange(0, BLOCK)[None, :]
        for offset in range(part * SPAN, part * SPAN + SPAN, BLOCK):
            e = tl.load(E + row * stride_row + offset + lanes, mask=lanes < vocab - offset, other=0.0)
            acc += e * (e >= levels[:, None]).to(tl.float32)  # compare + FMA (nucleus_reads)
        sums = tl.sum(acc.to(tl.float64), axis=1)
    tl.store(Partial + (row * tl.num_programs(1) + part) * LEVELS + tl.arange(0, LEVELS), sums)


@triton.jit
def _screen_narrow_kernel(Partial, Lo, Hi, Target, Skip, Settled, parts, unit, bound, slack,
                          M: tl.constexpr, LEVELS: tl.constexpr, PARTS: tl.constexpr):
    """Narrow a row on its screened sums where every level is surely reached or surely not. Settled: 1 for
    the rows narrowed here and the skipped ones, 0 for those the int64 pass must decide."""
    row = tl.program_id(0)
    slots = tl.arange(0, LEVELS)
    index = tl.arange(0, PARTS)
    sums = tl.sum(tl.load(Partial + (row * parts + index[:, None]) * LEVELS + slots[None, :],
                          mask=index[:, None] < parts, other=0.0), axis=0) * unit  # in units of the int64 masses
    target = tl.load(Target + row).to(tl.float64)
    surely_reached = sums / (1.0 + bound) - slack >= target
    surely_short = sums / (1.0 - bound) < target
    unsure = tl.sum((~(surely_reached | surely_short) & (slots < M)).to(tl.int32), axis=0)
    skipped = tl.load(Skip + row).to(tl.int32)
    count = tl.sum((surely_reached & (slots < M)).to(tl.int64), axis=0)
    lo, hi = tl.load(Lo + row), tl.load(Hi + row)
    narrowed_lo, narrowed_hi = _narrowed(lo, hi, count, M)
    screened = (skipped == 0) & (unsure == 0)
    tl.store(Lo + row, tl.where(screened, narrowed_lo, lo))
    tl.store(Hi + row, tl.where(screened, narrowed_hi, hi))
    tl.store(Settled + row, tl.where(screened | (skipped != 0), 1, 0).to(tl.int8))


def _part_sums_buffer(e: torch.Tensor, m: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[B, parts, LEVELS] for the programs' sums: a part per SPAN entries of the row, m levels padded to a
    power of two (at least 2, triton's smallest block)."""
    return torch.empty(e.shape[0], triton.cdiv(e.shape[1], SPAN), max(2, triton.next_power_of_2(m)),
                       dtype=dtype, device=e.device)


def narrow(e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, target: torch.Tensor, skip: torch.Tensor,
           shift: int, m: int) -> None:
    """One pass of the nucleus search, in place on lo, hi [B] (int64 bit patterns): with the m levels
    cut_j = lo + (hi − lo + 1) · j // (m + 1), j = 1..m, and c the number whose mass W(cut_j) reaches
    target [B], the interval becomes [lo + w c // (m + 1), lo + w (c + 1) // (m + 1) − 1]. Rows that
    `skip` [B] (int8) marks are not read and keep their interval."""
    rows, vocab = e.shape
    partial = _part_sums_buffer(e, m)
    width, parts = partial.shape[2], partial.shape[1]
    _cut_mass_kernel[(rows, parts)](e, lo, hi, skip, partial, vocab, e.stride(0), 2.0 ** shift,
                                    M=m, LEVELS=width, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    _narrow_kernel[(rows,)](partial, lo, hi, target, skip, parts, M=m, LEVELS=width,
                            PARTS=max(2, triton.next_power_of_2(parts)))


def screened_narrow(e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, target: torch.Tensor, skip: torch.Tensor,
                    shift: int, m: int, bound: float = SCREEN_BOUND, sums: torch.Tensor | None = None) -> torch.Tensor:
    """`narrow`, decided on float32 sums where they surely decide: the same lo, hi, bit for bit.

    With S the computed sum of e over a level's entries and V the vocabulary, the int64 mass W of the level
    (Σ floor(e · 2^shift), each term within 1 of e · 2^shift) lies in (S 2^shift / (1 + b) − V, S 2^shift / (1 − b)]
    for a rounding bound b (SCREEN_BOUND). Where every level's interval lies wholly at or above T, or below it,
    the levels reached are known, and the row narrows; the other rows take `narrow`'s int64 pass, which skips
    the rows screened or already skipped. The bound's margin over the float32 roundings (about 2^-19 of S)
    covers the float64 roundings of the test. Returns `settled` [B] int8: 0 for the rows the int64 pass decided.
    sums: the float32-screened sums [B, parts, LEVELS] (float64) of these levels where another read of e made them
    (`nucleus_reads.exp_and_mass` for the first pass, whose levels are every row's); none: this pass reads e."""
    rows, vocab = e.shape
    partial = _part_sums_buffer(e, m, torch.float64) if sums is None else sums
    width, parts = partial.shape[2], partial.shape[1]
    settled = torch.empty(rows, dtype=torch.int8, device=e.device)
    if sums is None:
        _screen_kernel[(rows, parts)](e, lo, hi, skip, partial, vocab, e.stride(0), M=m, LEVELS=width, SPAN=SPAN,
                                      BLOCK=SCREEN_BLOCK, num_warps=WARPS)
    _screen_narrow_kernel[(rows,)](partial, lo, hi, target, skip, settled, parts, 2.0 ** shift, bound,
                                   float(vocab), M=m, LEVELS=width, PARTS=max(2, triton.next_power_of_2(parts)))
    narrow(e, lo, hi, target, settled, shift, m)
    return settled


def mass_above(e: torch.Tensor, levels: torch.Tensor, shift: int, skip: torch.Tensor | None = None) -> torch.Tensor:
    """W [B, m] int64 for e [B, vocab] float32 (last dim contiguous) and levels [B, m] float32; rows that
    `skip` [B] (bool) marks are not read, and get 0."""
    if e.dtype != torch.float32 or levels.dtype != torch.float32:
        raise ValueError(f"mass_above needs float32 e and levels, got {e.dtype} and {levels.dtype}")
    if e.stride(-1) != 1:
        raise ValueError("mass_above needs e with a contiguous last dimension")
    rows, vocab = e.shape
    m = levels.shape[1]
    partial = _part_sums_buffer(e, m)
    width, parts = partial.shape[2], partial.shape[1]
    padded = levels.new_full((rows, width), float("inf"))
    padded[:, :m] = levels
    skip = torch.zeros(rows, dtype=torch.int8, device=e.device) if skip is None else skip.to(torch.int8)
    _mass_above_kernel[(rows, parts)](e, padded, skip, partial, vocab, e.stride(0), 2.0 ** shift,
                                      LEVELS=width, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    return partial.sum(1)[:, :m]
