"""Where a row's nucleus threshold is read off a few sorted entries instead of searched: one program per row.

The nucleus search (`sampling.nucleus_threshold`, docs/engine/nucleus.md) narrows an interval of float32 bit
patterns pass by pass. Two shortcuts resolve a row without the remaining passes; both sort a few entries
of e = exp(x - max x) descending, q_1 >= q_2 >= ..., and take as the threshold t the first q_n whose prefix
of integer masses A + w(q_1) + ... + w(q_n), w = floor(q 2^shift), reaches the target T = ceil(top_p W):

    start_search    at the start, among the row's likeliest entries: A = 0 and the entries at or above the
                    COUNT-th largest of the COUNT chunks with the largest maxima (section 4b)
    finish_search   after a few passes, among the entries of the row's interval that `nucleus_reads.collect`
                    gathered: A = the mass above the interval (section 4c)

As torch operations each was about thirty small kernels (top-k, gathers, sorts, cumulative sums, selects),
which in a CUDA graph cost the device a few microseconds each: most of the sampler's time where a trained
model's rows resolve from their likeliest tokens. Here each program reads what it needs of its row, sorts
in registers and writes the search's state: lo, hi (int64 bit patterns), skip (int8: the row is resolved),
known (int8: its threshold logit too) and cut (that logit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

START_WARPS = 8  # a [64, 128] tile of the row in registers
FINISH_WARPS = 4


@triton.jit
def _first_reaching(ordered, above, target, scale, SIZE: tl.constexpr):
    """(q_n, reached) for descending q [SIZE]: q_n the first value where above + w(q_1) + ... + w(q_n) reaches
    target, w = floor(q · scale) (int64); reached is false where none does."""
    prefix = above + tl.cumsum((ordered * scale).to(tl.int64), 0)
    n = tl.sum((prefix < target).to(tl.int32), 0)
    return tl.max(tl.where(tl.arange(0, SIZE) == n, ordered, 0.0), 0), n < SIZE


@triton.jit
def _kth_largest_bits(bits, k):
    """The bit pattern of the k-th largest of non-negative float32s given as their int32 bit patterns (which
    order as the floats do): the largest b with at least k patterns >= b, settled one bit at a time."""
    found = tl.zeros([], tl.int32)
    for bit in tl.static_range(30, -1, -1):
        trial = found | (1 << bit)
        found = tl.where(tl.sum((bits >= trial).to(tl.int32)) >= k, trial, found)
    return found


@triton.jit
def _top_chunks(Maxima, chunks, COUNT: tl.constexpr, CHUNKS: tl.constexpr):
    """The indices [COUNT] of a row's COUNT chunks with the largest maxima (the first on ties); indices >= chunks
    where the row has fewer. A chunk's maximum and index are packed into one int64 that sorts as the pair."""
    index = tl.arange(0, CHUNKS)
    maxima = tl.load(Maxima + index, mask=index < chunks, other=float("-inf"))
    bits = maxima.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32s that order as the floats do
    packed = (ordered.to(tl.int64) << 32) | (CHUNKS - 1 - index).to(tl.int64)
    ranked = tl.reshape(tl.sort(packed, descending=True), [CHUNKS // COUNT, COUNT])
    first = tl.sum(tl.where(tl.arange(0, CHUNKS // COUNT)[:, None] == 0, ranked, 0), 0)  # the first COUNT
    return CHUNKS - 1 - (first & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _start_kernel(X, E, Maxima, Target, Lo, Hi, Skip, Known, Cut, Scratch,
                  vocab, stride_row, chunks, count, x_scale, shift_scale, first, one_bits,
                  COUNT: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CAPACITY: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(Target + row)
    lo, hi = first.to(tl.int64), one_bits.to(tl.int64)
    resolved = tl.zeros([], tl.int1)
    known = tl.zeros([], tl.int1)
    cut = tl.full([], float("inf"), tl.float32)
    if COUNT > 0:
        chunk = _top_chunks(Maxima + row * chunks, chunks, COUNT, CHUNKS)
        index = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [COUNT, CHUNK]
        inside = (chunk[:, None] < chunks) & (index < vocab)
        e = tl.load(E + row * stride_row + index, mask=inside, other=0.0)  # padding weighs nothing, is never kept
        bits = e.to(tl.int32, bitcast=True)
        # the entries above the count-th largest (fewer than count), then as many of its ties as the slots hold:
        # the top of the row's order, as every entry of the row above the count-th largest is in these chunks
        kth = _kth_largest_bits(bits, count)
        above = tl.reshape(bits > kth, [COUNT * CHUNK])
        slot = tl.cumsum(above.to(tl.int32), 0) - 1
        tl.store(Scratch + row * CAPACITY + slot, tl.reshape(e, [COUNT * CHUNK]), mask=above)
        tl.debug_barrier()  # the program's stores, visible to all of its threads
        larger = tl.sum(above.to(tl.int32), 0)
        ties = tl.sum(tl.sum((bits == kth).to(tl.int32), 1), 0)
        slots = tl.arange(0, CAPACITY)
        values = tl.load(Scratch + row * CAPACITY + slots, mask=slots < larger, other=0.0)
        values = tl.where((slots >= larger) & (slots < larger + ties), kth.to(tl.float32, bitcast=True), values)
        t, resolved = _first_reaching(tl.sort(values, descending=True), 0, target, shift_scale, CAPACITY)
        # every entry at or above t is in these chunks where t tops the least of their maxima (or they are all)
        least_max = tl.min(tl.max(e, 1), 0)
        known = resolved & ((t > least_max) | (COUNT >= chunks))
        x = tl.load(X + row * stride_row + index, mask=inside, other=float("inf")) * x_scale
        cut = tl.where(known, tl.min(tl.min(tl.where(e >= t, x, float("inf")), 1), 0), float("inf"))
        t_bits = t.to(tl.int32, bitcast=True).to(tl.int64)
        lo = tl.where(resolved, t_bits, lo)
        hi = tl.where(resolved, t_bits, hi)
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
        values = tl.load(Values + slot, mask=valid, other=0.0)  # an empty slot weighs nothing and sorts last
        ordered = tl.sort(tl.reshape(values, [PARTS * CAPACITY]), descending=True)
        t, _ = _first_reaching(ordered, above, tl.load(Target + row), shift_scale, PARTS * CAPACITY)
        logits = tl.load(X + row * stride_row + tl.load(Index + slot, mask=valid, other=0), mask=valid) * x_scale
        t_bits = t.to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(Lo + row, t_bits)
        tl.store(Hi + row, t_bits)
        tl.store(Skip + row, tl.full([], 1, tl.int8))
        tl.store(Known + row, tl.full([], 1, tl.int8))
        tl.store(Cut + row, tl.min(tl.min(tl.where(values >= t, logits, float("inf")), 1), 0))  # empty: 0 < t


def start_search(x: torch.Tensor, e: torch.Tensor, maxima: torch.Tensor, target: torch.Tensor, shift: int, first: int,
                 one_bits: int, count: int, chunk: int, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """The search's state at its start: (lo, hi [B] int64, skip, known [B] int8, cut [B] float32).

    x [B, V] the logits (scaled by `scale` as they are read), e = exp(x · scale - max) (`nucleus_reads.exp_and_mass`),
    target [B] int64 the masses T, maxima [B, chunks] those of x · scale over chunks of `chunk` entries
    (`nucleus_reads.chunk_maxima`). (T comes from torch in float64: a triton kernel takes a Python float such as
    top_p as a float32.) A row whose `count` likeliest entries reach the target (`count` 0: none) starts
    resolved, lo = hi = its threshold t; the others at [first, one_bits].
    Where t tops the least maximum of the chunks read (or they are the whole row), the threshold logit
    min {x_i · scale : e_i >= t} is known too: cut. The likeliest entries are those above the count-th largest,
    then up to 2 count in all of its ties."""
    rows, vocab = x.shape
    chunks = maxima.shape[1]
    tile = min(triton.next_power_of_2(count), triton.next_power_of_2(chunks)) if count > 0 else 0  # chunks read
    lo, hi = (torch.empty(rows, dtype=torch.int64, device=x.device) for _ in range(2))
    skip, known = (torch.empty(rows, dtype=torch.int8, device=x.device) for _ in range(2))
    cut = torch.empty(rows, dtype=torch.float32, device=x.device)
    capacity = 2 * triton.next_power_of_2(max(count, 1))
    scratch = torch.empty(rows, capacity, dtype=torch.float32, device=x.device)
    _start_kernel[(rows,)](x, e, maxima, target, lo, hi, skip, known, cut, scratch, vocab, x.stride(0), chunks, count,
                           scale, 2.0 ** shift, first, one_bits, COUNT=tile, CHUNK=chunk,
                           CHUNKS=max(2, triton.next_power_of_2(chunks)), CAPACITY=capacity, num_warps=START_WARPS)
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
