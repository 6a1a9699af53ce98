"""The Gumbel-max pick on CUDA in one read of the logits: the sampler's last step, fused.

For logits x [B, V] (float32), inverse temperature r (a float32 number), cut threshold c [B, 1]
and the counter noise U:

    s_i = x_i · r                                   (float32 product, as torch's)
    token = argmax_i (s_i if s_i >= c else -inf) + G_i,   G_i = -log(-log U_i)  (float64, first index on ties)
    log-prob = s_token - logsumexp{s_i : s_i >= c},   untruncated = s_token - logsumexp_i s_i

`sampling.gumbel_pick` computes the same with torch ops, which read and write [B, V] several
times. Here grid (rows, parts of the vocabulary): each program hashes the noise of its part,
keeps per-lane running maxima and online sums in registers, reduces them across threads once
at the end and writes one partial per (row, part); one program per row then combines the parts.
Both kernels read the counters themselves: in a CUDA graph each small torch op around them costs a
few microseconds, and hashing the rows' counters with torch ops was about forty of them. Under a cut,
a block of entries none of which is kept has only -inf keys, so its noise is not hashed: where a
trained model's nucleus is a few tokens, that is nearly every block, and the pick is its sums.

After a nucleus search (`SearchSums`) even those sums need not be read: the search has the maxima of
every chunk of the scaled logits, which say which blocks keep nothing, and the row's whole mass, which is
the untruncated log-probs' normalizer. The pick then reads only the blocks that keep something, and sums
over the kept entries alone; a part that keeps nothing stores the partials of no entry and stops.

The float64 keys are the definition, but two float64 logarithms per entry made the kernel
compute-bound (0.43 ms at B = 256, V = 151,936 on an H200). So a program ranks its entries by
float32 keys, whose error is far below MARGIN (`gumbel_noise32`), and computes the float64 key of
its winner alone. On the card the float32 logarithms and exponentials are the hardware's approximate
ones and the noise takes no division: at top-p 1.0 a program's loop is arithmetic, about 49
instructions an entry as triton 3.9 builds it for sm_90 at Qwen's vocabulary (benchmarks/RESULTS.md,
twenty-ninth and thirty-first series). When another entry's float32 key comes within MARGIN of the
winner's, the order could differ, and the program ranks its part again in float64, as the definition
does (about one program in 10^4). Tokens therefore equal `gumbel_pick`'s: the keys are the same
float64 numbers and ties go to the first index within a lane, a program and across parts.
Log-probs agree to float32 rounding (the sums run in another order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

SPAN = 8192  # vocabulary entries per program: 19 parts per row at a vocabulary of 151,936
BLOCK = 1024  # entries per loop iteration
WARPS = 8
# A winner by float32 keys is taken when no other entry of its part comes within MARGIN · max(1, |key|)
# of it. The float32 key's error is below 8e-6 + ulp(key) (gumbel_noise32 with the hardware's logarithms, up to
# |G| = 17.3: 4e-6 at their documented worst; accurate ones, which triton's interpreter runs, keep 2e-6;
# tests/test_gumbel_kernel.py checks every counter value on the device), and a difference of two keys needs
# twice that.
MARGIN = 2.0**-14


class SearchSums(NamedTuple):
    """What a nucleus search has already read off the scaled logits s = logits · r, for the pick to reuse."""

    chunk_maxima: torch.Tensor  # [B, ceil(V / chunk)] float32: the max of s over each chunk
    chunk: int  # entries a chunk, a power of two dividing BLOCK
    row_max: torch.Tensor  # [B] float32: the max of s
    mass: torch.Tensor  # [B] int64: sum_i floor(exp(s_i - row_max) · 2^shift)
    shift: int

    # log sum_i exp(s_i), the untruncated log-probs' normalizer, is row_max + log(mass · 2^-shift) to float32
    # rounding: the mass falls short of the sum of exponentials by less than V · 2^-shift, and that sum is >= 1.


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_hash(seed, position):
    """`sampling.noise_row_hash` of one row's (seed, position), both int64: the same 32-bit value."""
    low = (seed & 0xFFFFFFFF).to(tl.uint32)
    high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _fmix32(low ^ _fmix32(high ^ 0x9E3779B9))
    return _fmix32(h ^ (position.to(tl.uint32) * 0x27D4EB2F))  # uint32 arithmetic wraps


@triton.jit
def _noise_hash(row_hash, index):
    return _fmix32(row_hash ^ (index.to(tl.uint32) * 0x165667B1 + 0x61C88647))  # uint32 arithmetic wraps


@triton.jit
def _gumbel64(h):
    """G = -log(-log U) in float64 for U = ((h >> 8) + 1/2) / 2^24: the definition."""
    u = ((h >> 8).to(tl.float64) + 0.5) * (1.0 / (1 << 24))
    return -tl.log(-tl.log(u))


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2 x (float32): with FAST the hardware's approximate one (one instruction; within 2^-22 for x in [1/2, 2],
    2 ulps elsewhere), else an accurate one. Triton's interpreter has no libdevice."""
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """e^x (float32): with FAST the hardware's exp2 of x · log2 e with results below 2^-126 flushed to 0 (two
    instructions; the online sums below always hold a term of 1, which such a term cannot change), else triton's
    exp, which scales them back (three more)."""
    if FAST:
        return libdevice.fast_expf(x)
    return tl.exp(x)


@triton.jit
def _gumbel32(h, FAST: tl.constexpr):
    """G in float32, a few float32 ulps of the float64 G over every counter value, |G| below 17.3 (with FAST, the
    hardware's logarithms: within 8e-6).

    Through E = -log2 U: G = -ln(E · ln 2) = -ln 2 · log2 E - ln ln 2. U is exact in float32 below 1/2 and
    rounded once above; that rounding and the hardware log2's absolute error near 1 stay far below E's own size
    while U <= 1 - 2^-4. Above it E = log2(e) · (m + m²/2 + ... + m⁵/5) with m = 1 - U exact: the terms left out
    are below m⁵/6 < 2e-7 of E, the relative accuracy that the outer log needs as U -> 1.
    """
    k = h >> 8
    kf = k.to(tl.float32)
    u = kf * (1.0 / (1 << 24)) + (1.0 / (1 << 25))  # (k + 1/2) / 2^24: one rounding, as a sum
    m = (1.0 - kf * (1.0 / (1 << 24))) - (1.0 / (1 << 25))  # 1 - U: exact where the series takes it
    series = 1.4426950408889634 / 4 + m * (1.4426950408889634 / 5)
    series = 1.4426950408889634 / 3 + m * series
    series = 1.4426950408889634 / 2 + m * series
    series = 1.4426950408889634 + m * series
    minus_log2_u = tl.where(k < (1 << 24) - (1 << 20), -_log2(u, FAST), m * series)
    return _log2(minus_log2_u, FAST) * -0.6931471805599453 + 0.36651292058166435


@triton.jit
def _rank_block(kept, row_hash, index, best, second, best_index, FAST: tl.constexpr):
    """Each lane's largest float32 key kept + G (the first index on ties), and the largest of its others."""
    key = kept + _gumbel32(_noise_hash(row_hash, index), FAST)
    better = key > best  # strict: a lane keeps the first index of its maximum
    return tl.where(better, key, best), tl.where(better, best, tl.maximum(second, key)), tl.where(better, index,
                                                                                                  best_index)


@triton.jit
def _online_logsumexp(top, total, s, FAST: tl.constexpr):
    """Fold s into per-lane (max, sum of exp(s - max)) with one exponential an entry, e = exp(-|s - top|): the
    rescaling of the sum when s is a new max (the term of s is then exp(0) = 1), s's own term otherwise (the
    rescaling is then by exp(0) = 1): the sums of exponentiating both differences from the new max, with one
    exponential fewer. Lanes that saw only -inf keep (-inf, 0). Also returns e and whether s rose."""
    rises = s > top
    e = _exp(tl.where(rises, top - s, s - top), FAST)
    e = tl.where(s == float("-inf"), 0.0, e)  # -inf - (-inf) is nan; a -inf entry adds nothing
    return tl.maximum(top, s), tl.where(rises, total * e + 1.0, total + e), e, rises


@triton.jit
def _fold_kept(kept_total, kept, e, rises):
    """The sum of exp(s - max) over a lane's kept entries, against the lane's max over all of its entries, from
    the same e as the whole sum. A lane's max is kept as soon as any of its entries is (kept entries are those
    >= the cut), so a rise by an entry that is not kept rescales a kept sum of 0, and the two sums share their
    max without losing precision."""
    return tl.where(rises, kept_total * e + kept.to(tl.float32), kept_total + tl.where(kept, e, 0.0))


@triton.jit
def _part_total(top, total, part_top):
    """Per-lane sums of exp(s - top) [BLOCK] as one sum of exp(s - part_top), part_top the lanes' max."""
    anchor = tl.where(part_top == float("-inf"), 0.0, part_top)
    return tl.sum(total * tl.exp(top - anchor), 0)


@triton.jit
def _rank_in_float64(Logits, row_hash, cut, inverse_temperature, vocab, start,
                     SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """(largest float64 key, its first index) over the part [start, start + SPAN): the definition."""
    best_key = tl.full([BLOCK], float("-inf"), tl.float64)
    best_index = tl.zeros([BLOCK], tl.int32)
    for offset in range(0, SPAN, BLOCK):
        index = start + offset + tl.arange(0, BLOCK)
        x = tl.load(Logits + index, mask=index < vocab, other=float("-inf"))
        s = x * inverse_temperature
        key = tl.where(s >= cut, s, float("-inf")).to(tl.float64) + _gumbel64(_noise_hash(row_hash, index))
        better = key > best_key  # strict: a lane keeps the first index of its maximum
        best_key = tl.where(better, key, best_key)
        best_index = tl.where(better, index, best_index)
    top_key = tl.max(best_key, 0)
    return top_key, tl.min(tl.where(best_key == top_key, best_index, vocab), 0)


@triton.jit
def _gumbel_pick_kernel(Logits, Seeds, Positions, Threshold, inverse_temperature, vocab, stride_row, margin,
                        BestKey, BestIndex, KeptTotal, FullTop, FullTotal, ChunkMaxima, chunks,
                        CUT: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        FAST_MATH: tl.constexpr):
    """Each part's winner, and its sums: of the whole part (FullTop, FullTotal) and of its kept entries against
    the same maxima (KeptTotal); with chunk maxima (CHUNK > 0), of its kept entries alone (FullTop, KeptTotal)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    out = row * tl.num_programs(1) + part
    cut = tl.load(Threshold + row) if CUT else float("-inf")
    if CHUNK:  # a part whose chunks all lie below the cut keeps nothing: its partials are those of no entry
        span = part * (SPAN // CHUNK) + tl.arange(0, SPAN // CHUNK)
        if tl.max(tl.load(ChunkMaxima + row * chunks + span, mask=span < chunks, other=float("-inf")), 0) < cut:
            tl.store(BestKey + out, float("-inf"))
            tl.store(BestIndex + out, 0)
            tl.store(FullTop + out, float("-inf"))
            tl.store(KeptTotal + out, 0.0)
            return
    row_logits = Logits + row * stride_row
    row_hash = _row_hash(tl.load(Seeds + row), tl.load(Positions + row))
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's largest float32 key
    second = tl.full([BLOCK], float("-inf"), tl.float32)  # and the largest of its others (ties included)
    best_index = tl.zeros([BLOCK], tl.int32)
    kept_total = tl.zeros([BLOCK], tl.float32)
    full_top = tl.full([BLOCK], float("-inf"), tl.float32)
    full_total = tl.zeros([BLOCK], tl.float32)
    lanes = tl.arange(0, BLOCK)
    for offset in range(0, SPAN, BLOCK):
        start = part * SPAN + offset
        index = start + lanes
        # index < vocab as the lanes' own offsets against what is left: the compiler widens index to 64 bits
        # with the addresses, where a compare costs four instructions an entry instead of one
        inside = lanes < vocab - start
        if CHUNK:  # a block whose chunks all lie below the cut keeps nothing: it is not read
            chunk = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
            block_top = tl.max(tl.load(ChunkMaxima + row * chunks + chunk, mask=chunk < chunks,
                                       other=float("-inf")), 0)
            if block_top >= cut:
                s = tl.load(row_logits + index, mask=inside, other=float("-inf")) * inverse_temperature
                kept = tl.where(s >= cut, s, float("-inf"))
                best, second, best_index = _rank_block(kept, row_hash, index, best, second, best_index, FAST_MATH)
                full_top, kept_total, _, _ = _online_logsumexp(full_top, kept_total, kept, FAST_MATH)
        else:
            x = tl.load(row_logits + index, mask=inside, other=float("-inf"))
            s = x * inverse_temperature
            inside_cut = s >= cut
            if CUT:
                # a block with nothing kept has every key -inf, which changes no lane's best or second: its noise
                # is not hashed (at a trained model's top-p 0.9 that is nearly every block)
                if tl.max(s, 0) >= cut:
                    best, second, best_index = _rank_block(tl.where(inside_cut, s, float("-inf")), row_hash, index,
                                                           best, second, best_index, FAST_MATH)
            else:
                best, second, best_index = _rank_block(s, row_hash, index, best, second, best_index, FAST_MATH)
            full_top, full_total, e, rises = _online_logsumexp(full_top, full_total, s, FAST_MATH)
            if CUT:
                kept_total = _fold_kept(kept_total, inside_cut, e, rises)
    top = tl.max(best, 0)
    near = top - margin * tl.maximum(tl.abs(top), 1.0)
    contested = (tl.sum((best >= near).to(tl.int32), 0) > 1) | (tl.max(second, 0) >= near)
    # the float32 winner and its float64 key, computed for that one entry
    index = tl.min(tl.where(best == top, best_index, vocab), 0)
    s = tl.load(row_logits + index, mask=top > float("-inf"), other=float("-inf")) * inverse_temperature
    top_key = tl.where(top > float("-inf"), s.to(tl.float64) + _gumbel64(_noise_hash(row_hash, index)),
                       float("-inf"))
    index = tl.where(top > float("-inf"), index, 0)  # a part with nothing kept: -inf at index 0, as in float64
    if contested & (top > float("-inf")):
        top_key, index = _rank_in_float64(row_logits, row_hash, cut, inverse_temperature, vocab, part * SPAN,
                                          SPAN, BLOCK)
    tl.store(BestKey + out, top_key)
    tl.store(BestIndex + out, index)
    part_top = tl.max(full_top, 0)
    tl.store(FullTop + out, part_top)
    if not CHUNK:
        tl.store(FullTotal + out, _part_total(full_top, full_total, part_top))
    if CUT:  # against the same max: the part's kept logsumexp is FullTop + log(KeptTotal)
        tl.store(KeptTotal + out, _part_total(full_top, kept_total, part_top))


@triton.jit
def _gumbel_noise32_kernel(Counters, Out, n, BLOCK: tl.constexpr, FAST_MATH: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(Counters + index, mask=index < n, other=0).to(tl.uint32)
    tl.store(Out + index, _gumbel32(k << 8, FAST_MATH), mask=index < n)


# Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run in numpy, without libdevice.
INTERPRETED = not isinstance(_gumbel_noise32_kernel, JITFunction)


def gumbel_noise32(counters: torch.Tensor) -> torch.Tensor:
    """The pick's float32 G [n] of 24-bit counter values k [n] (int32), U = (k + 1/2) / 2^24: for checking
    its error against the float64 definition, -log(-log U)."""
    out = torch.empty(counters.shape, dtype=torch.float32, device=counters.device)
    _gumbel_noise32_kernel[(triton.cdiv(counters.numel(), BLOCK),)](counters, out, counters.numel(), BLOCK=BLOCK,
                                                                    FAST_MATH=not INTERPRETED)
    return out


@triton.jit
def _part_logsumexp(Top, Total, at, inside):
    """logsumexp over a row's parts from their (max, sum of exp(s - max)) at offsets `at`."""
    top = tl.load(Top + at, mask=inside, other=float("-inf"))
    row_top = tl.max(top, 0)
    return row_top + tl.log(tl.sum(tl.load(Total + at, mask=inside, other=0.0) * tl.exp(top - row_top), 0))


@triton.jit
def _combine_kernel(BestKey, BestIndex, KeptTotal, FullTop, FullTotal, RowMax, Mass, mass_scale, Logits, stride_row,
                    inverse_temperature, parts, Tokens, LogProbs, FullLogProbs, CUT: tl.constexpr,
                    PARTS: tl.constexpr, SEARCHED: tl.constexpr):
    """One program per row: the winner among the parts' winners (the first part on ties) and its log-probs; when
    SEARCHED, the untruncated one against the search's sums (`SearchSums`)."""
    row = tl.program_id(0)
    part = tl.arange(0, PARTS)
    inside = part < parts
    at = row * parts + part
    key = tl.load(BestKey + at, mask=inside, other=float("-inf"))
    first = tl.min(tl.where(key == tl.max(key, 0), part, PARTS), 0)
    token = tl.load(BestIndex + row * parts + first).to(tl.int64)
    picked = tl.load(Logits + row * stride_row + token) * inverse_temperature
    tl.store(Tokens + row, token)
    if SEARCHED:
        normalizer = tl.load(RowMax + row) + tl.log(tl.load(Mass + row).to(tl.float32) * mass_scale)
        tl.store(FullLogProbs + row, picked - normalizer)
    else:
        tl.store(FullLogProbs + row, picked - _part_logsumexp(FullTop, FullTotal, at, inside))
    if CUT:  # the kept sums share the whole sums' maxima
        tl.store(LogProbs + row, picked - _part_logsumexp(FullTop, KeptTotal, at, inside))


def fused_gumbel_pick(logits: torch.Tensor, inverse_temperature: float, threshold: torch.Tensor | None,
                      seeds: torch.Tensor, positions: torch.Tensor, margin: float = MARGIN,
                      search: SearchSums | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B], untruncated log-probs [B]) for float32 logits [B, V] (last dim contiguous).

    inverse_temperature: `sampling.inverse_temperature(T)`; threshold [B, 1] float32 applies to
    logits · inverse_temperature (None: nothing is cut, and both log-probs are the same numbers);
    seeds, positions [B] int64: the noise's counters (`sampling.noise_row_hash` of them, hashed in the kernel).
    margin: the float32 keys' tie band (inf: every part ranks in float64; the tests use it to check both paths).
    search: the nucleus search's sums of these logits under this threshold: only the blocks that keep something
    are read. Same tokens; the log-probs agree to float32 rounding.
    Two kernels: the parts' winners and sums, then one program per row that combines them.
    """
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"fused_gumbel_pick needs float32 logits with a contiguous last dimension, got {logits.dtype}")
    rows, vocab = logits.shape
    chunk = 0
    if search is not None:
        chunk = search.chunk
        if threshold is None or BLOCK % chunk or chunk & (chunk - 1) or search.chunk_maxima.shape != (
                rows, triton.cdiv(vocab, chunk)) or (rows,) != search.row_max.shape or (rows,) != search.mass.shape:
            raise ValueError(f"search sums of logits {tuple(logits.shape)} need a threshold, chunks of a power of "
                             f"two dividing {BLOCK}, maxima [rows, chunks], a row max and a mass [rows]; got chunk "
                             f"{chunk}, {tuple(search.chunk_maxima.shape)}, {tuple(search.row_max.shape)}, "
                             f"{tuple(search.mass.shape)}")
    parts = triton.cdiv(vocab, SPAN)
    best_key = torch.empty(rows, parts, dtype=torch.float64, device=logits.device)
    best_index = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    full_top, full_total = (torch.empty(rows, parts, dtype=torch.float32, device=logits.device) for _ in range(2))
    kept_total = full_total
    cut = threshold is not None
    if cut:
        kept_total = torch.empty_like(full_total)
        threshold = threshold.float().contiguous()
    seeds, positions = seeds.long().contiguous(), positions.long().contiguous()
    maxima = search.chunk_maxima.contiguous() if search is not None else logits  # (unread without a search)
    _gumbel_pick_kernel[(rows, parts)](logits, seeds, positions, threshold if cut else logits, inverse_temperature,
                                       vocab, logits.stride(0), margin, best_key, best_index, kept_total,
                                       full_top, full_total, maxima, maxima.shape[-1], CUT=cut, SPAN=SPAN,
                                       BLOCK=BLOCK, CHUNK=chunk, FAST_MATH=not INTERPRETED, num_warps=WARPS)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    full = torch.empty(rows, dtype=torch.float32, device=logits.device)
    kept = torch.empty_like(full) if cut else full
    searched = search is not None
    row_max, mass = (search.row_max.float().contiguous(), search.mass.contiguous()) if searched else (full, full)
    _combine_kernel[(rows,)](best_key, best_index, kept_total, full_top, full_total, row_max, mass,
                             2.0 ** -search.shift if searched else 1.0, logits, logits.stride(0), inverse_temperature,
                             parts, tokens, kept, full, CUT=cut, PARTS=max(2, triton.next_power_of_2(parts)),
                             SEARCHED=searched, num_warps=1)
    return tokens, kept, full
