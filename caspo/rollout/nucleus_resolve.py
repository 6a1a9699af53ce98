"""Where a row's nucleus threshold is read off a few of its entries instead of searched: one program per row.

The nucleus search (`sampling.nucleus_threshold`, docs/engine/nucleus.md) narrows an interval of float32 bit
patterns pass by pass. Two shortcuts resolve a row without the remaining passes. Both hold a set G of entries
of e = exp(x - max x) that contains every entry of the row above some level L, and a mass A of entries above
them all; the threshold t is then the largest value b with

    A + sum of w(g) over {g in G : g >= b}  >=  T,     w = floor(g 2^shift),  T = ceil(top_p W),

wherever b >= L (there the sum is the row's mass W(b), which falls as b rises; section 2 in integer masses).
A program finds it bit by bit from the top of the float32 patterns, 31 masked sums over G, with no sort:

    start_search    at the start: G the entries of the COUNT chunks with the largest maxima (ties by index),
                    L the least of those maxima, A = 0 (section 4b)
    finish_search   after a few passes: G the entries of the row's interval that `nucleus_reads.collect`
                    gathered, L its low end, A the mass above the interval (section 4c)

As torch operations each was about thirty small kernels (top-k, gathers, sorts, cumulative sums, selects),
which in a CUDA graph cost the device a few microseconds each. Each program writes the search's state itself:
lo, hi (int64 bit patterns), skip (int8: the row is resolved), known (int8: its threshold logit too) and cut
(that logit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

START_WARPS = 8  # a [64, 128] tile of the row in registers
FINISH_WARPS = 4


@triton.jit
def _largest_level(levels, weight, base, target, BITS: tl.constexpr):
    """The largest b in [0, 2^BITS) with base + the sum of weight over {levels >= b} at least target (0 where
    none is), for levels [N] of non-negative integers: settled one bit at a time from the top, as the sum
    falls while b rises."""
    found = tl.zeros([], levels.dtype)
    for bit in tl.static_range(BITS - 1, -1, -1):
        trial = found | (1 << bit)
        found = tl.where(base + tl.sum(tl.where(levels >= trial, weight, 0), 0) >= target, trial, found)
    return found


@triton.jit
def _largest_entry_level(values, shift_scale, base, target, BITS: tl.constexpr):
    """`_largest_level` of float32 values [N] >= 0 by their bit patterns, each weighing w = floor(value 2^shift).
    Each sum forms the weights of the entries it takes, so the int64 weights of all N never live at once."""
    levels = values.to(tl.int32, bitcast=True)
    found = tl.zeros([], tl.int32)
    for bit in tl.static_range(BITS - 1, -1, -1):
        trial = found | (1 << bit)
        mass = tl.sum((tl.where(levels >= trial, values, 0.0) * shift_scale).to(tl.int64), 0)  # w(0) = 0
        found = tl.where(base + mass >= target, trial, found)
    return found


@triton.jit
def _top_chunks(Maxima, Chosen, chunks, COUNT: tl.constexpr, CHUNKS: tl.constexpr):
    """The indices [COUNT] of a row's chunks whose maxima top the COUNT-th largest, then of its ties in index
    order, COUNT in all (indices >= chunks where the row has fewer), through Chosen [COUNT] (scratch)."""
    index = tl.arange(0, CHUNKS)
    bits = tl.load(Maxima + index, mask=index < chunks, other=float("-inf")).to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + (1 << 31)  # in [0, 2^32), in the floats' order
    kth = _largest_level(key, 1, 0, COUNT, BITS=32)
    tie = key == kth
    taken = (key > kth) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= COUNT - tl.sum((key > kth).to(tl.int32), 0)))
    tl.store(Chosen + tl.cumsum(taken.to(tl.int32), 0) - 1, index, mask=taken)
    tl.debug_barrier()  # the program's stores, visible to all of its threads
    return tl.load(Chosen + tl.arange(0, COUNT))


@triton.jit
def _start_kernel(X, E, Maxima, Target, Lo, Hi, Skip, Known, Cut, Chosen, vocab, stride_row, chunks, x_scale,
                  shift_scale, first, one_bits, COUNT: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(Target + row)
    lo, hi = first.to(tl.int64), one_bits.to(tl.int64)
    resolved = tl.zeros([], tl.int1)
    known = tl.zeros([], tl.int1)
    cut = tl.full([], float("inf"), tl.float32)
    if COUNT > 0:
        chunk = _top_chunks(Maxima + row * chunks, Chosen + row * COUNT, chunks, COUNT, CHUNKS)
        index = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [COUNT, CHUNK]
        inside = (chunk[:, None] < chunks) & (index < vocab)
        e = tl.load(E + row * stride_row + index, mask=inside, other=0.0)  # padding weighs nothing, is never kept
        # every entry of the row above the least of these chunks' maxima is in them (e rises with x)
        least = tl.min(tl.max(e, 1), 0)
        # read for every row: read under the branch below, the program needs 184-228 registers instead of 128
        x = tl.load(X + row * stride_row + index, mask=inside, other=float("inf")) * x_scale
        resolved = tl.sum((tl.where(e >= least, e, 0.0) * shift_scale).to(tl.int64)) >= target
        if resolved:  # a row these chunks do not resolve (every row of a flat one) skips the 31 sums
            t_bits = _largest_entry_level(tl.reshape(e, [COUNT * CHUNK]), shift_scale, 0, target, BITS=31)
            t = t_bits.to(tl.float32, bitcast=True)
            # the threshold logit too, where every entry at or above t is in these chunks (or they are all)
            known = (t > least) | (COUNT >= chunks)
            cut = tl.where(known, tl.min(tl.min(tl.where(e >= t, x, float("inf")), 1), 0), float("inf"))
            lo = t_bits.to(tl.int64)
            hi = lo
    tl.store(Lo + row, lo)
    tl.store(Hi + row, hi)
    tl.store(Skip + row, resolved.to(tl.int8))
    tl.store(Known + row, known.to(tl.int8))
    tl.store(Cut + row, cut)


@triton.jit
def _finish_kernel(X, Values, Index, Counts, Above, Target, Lo, Hi, Skip, Known, Cut, stride_row, parts, x_scale,
                   shift_scale, CAPACITY: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    part = tl.arange(0, PARTS)
    counts = tl.load(Counts + row * parts + part, mask=part < parts, other=0)
    if (tl.load(Skip + row) == 0) & (tl.max(counts, 0) <= CAPACITY):  # the interval gathered whole
        above = tl.sum(tl.load(Above + row * parts + part, mask=part < parts, other=0), 0)
        slot = (row * parts + part[:, None]) * CAPACITY + tl.arange(0, CAPACITY)[None, :]  # [PARTS, CAPACITY]
        valid = tl.arange(0, CAPACITY)[None, :] < counts[:, None]  # past a part's count: empty (or garbage)
        values = tl.load(Values + slot, mask=valid, other=0.0)  # an empty slot weighs nothing
        flat = tl.reshape(values, [PARTS * CAPACITY])
        # the whole interval's mass, W(lo) >= T, so some gathered entry reaches the target
        t_bits = _largest_entry_level(flat, shift_scale, above, tl.load(Target + row), BITS=31)
        t = t_bits.to(tl.float32, bitcast=True)
        logits = tl.load(X + row * stride_row + tl.load(Index + slot, mask=valid, other=0), mask=valid) * x_scale
        tl.store(Lo + row, t_bits.to(tl.int64))
        tl.store(Hi + row, t_bits.to(tl.int64))
        tl.store(Skip + row, tl.full([], 1, tl.int8))
        tl.store(Known + row, tl.full([], 1, tl.int8))
        tl.store(Cut + row, tl.min(tl.min(tl.where(values >= t, logits, float("inf")), 1), 0))  # empty: 0 < t


def start_search(x: torch.Tensor, e: torch.Tensor, maxima: torch.Tensor, target: torch.Tensor, shift: int, first: int,
                 one_bits: int, count: int, chunk: int, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """The search's state at its start: (lo, hi [B] int64, skip, known [B] int8, cut [B] float32).

    x [B, V] the logits (scaled by `scale` as they are read), e = exp(x · scale - max) (`nucleus_reads.exp_and_mass`),
    target [B] int64 the masses T, maxima [B, chunks] those of x · scale over chunks of `chunk` entries
    (`nucleus_reads.chunk_maxima`). (T comes from torch in float64: a triton kernel takes a Python float such as
    top_p as a float32.) A row whose `count` chunks with the largest maxima (rounded up to a power of two; 0:
    none) hold the target's mass above the least of those maxima starts resolved, lo = hi = its threshold t; the
    others at [first, one_bits]. Where t tops that least maximum (or the chunks are the whole row), the threshold
    logit min {x_i · scale : e_i >= t} is known too: cut."""
    rows, vocab = x.shape
    chunks = maxima.shape[1]
    tile = min(triton.next_power_of_2(count), triton.next_power_of_2(chunks)) if count > 0 else 0  # chunks read
    lo, hi = (torch.empty(rows, dtype=torch.int64, device=x.device) for _ in range(2))
    skip, known = (torch.empty(rows, dtype=torch.int8, device=x.device) for _ in range(2))
    cut = torch.empty(rows, dtype=torch.float32, device=x.device)
    chosen = torch.empty(rows, max(tile, 1), dtype=torch.int32, device=x.device)
    _start_kernel[(rows,)](x, e, maxima, target, lo, hi, skip, known, cut, chosen, vocab, x.stride(0), chunks, scale,
                           2.0 ** shift, first, one_bits, COUNT=tile, CHUNK=chunk,
                           CHUNKS=max(2, triton.next_power_of_2(chunks)), num_warps=START_WARPS)
    return lo, hi, skip, known, cut


def finish_search(x: torch.Tensor, gathered: tuple[torch.Tensor, ...], target: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, skip: torch.Tensor, known: torch.Tensor, cut: torch.Tensor, shift: int,
                  scale: float = 1.0) -> None:
    """Resolve in place every searching row whose interval `collect` gathered whole (no part past its capacity):
    lo = hi = its threshold t, skip and known set, cut its threshold logit, the least gathered x · scale at or
    above t (every entry at or above t is above the interval, with a larger logit, or gathered).
    gathered: `collect`'s (values, index, counts, above)."""
    values, index, counts, above = gathered
    rows, parts, capacity = values.shape
    _finish_kernel[(rows,)](x, values, index, counts, above, target, lo, hi, skip, known, cut, x.stride(0), parts,
                            scale, 2.0 ** shift, CAPACITY=capacity, PARTS=max(2, triton.next_power_of_2(parts)),
                            num_warps=FINISH_WARPS)
