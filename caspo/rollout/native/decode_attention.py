"""Split-K ("flash-decoding") grouped-query attention for one query token per sequence, in Triton.

What it computes: for row b and query head h (KV head j = h // G, G = H / Hkv query heads per KV
head, as transformers' repeat_kv maps them), over the keys n < lengths[b] of cache slot s = slots[b],

    out[b, h] = sum_n softmax_n(scale · q[b, h] · K[s, j, n]) · V[s, j, n]

Why split-K: a decode step does almost no arithmetic per byte; its time is reading K and V once.
One program per (row, KV head) is B·Hkv programs each walking a whole sequence: at small batch or
long keys most SMs sit idle. So the keys [0, key_len) are cut into `num_splits` chunks:

    stage 1, grid (B, Hkv, splits): each program reads its chunk of K/V once and keeps an online
        softmax (running max m, running sum l, accumulator acc, all fp32); it writes o = acc / l and
        lse = m + log(l) per query head to fp32 scratch. A chunk past lengths[b] writes lse = -inf.
    stage 2, grid (B, Hkv): out = sum_s exp(lse_s - M) · o_s / sum_s exp(lse_s - M), M = max_s lse_s,
        so empty chunks weigh exactly 0 (their o is not read). With a single split, stage 1 writes the
        output itself.

GQA folding: the G query heads of one KV head are the rows of one matrix [G, D] (padded to 16 rows
for tl.dot), so each K/V block is loaded once and serves all G heads with two small matmuls.

CUDA graphs: grid and chunk sizes depend only on (B, H, Hkv, D, key_len); the lengths are read on
the device, so a captured call replays correctly with new lengths. The kernels work in base 2
(exp2/log2, with log2(e) folded into the scale; lse is log2 of the sum): the same softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Launch configuration (module constants so a benchmark can tune them on the card).
BLOCK_N = 64  # keys per block of the stage-1 loop
NUM_WARPS = 4
NUM_STAGES = 2  # K/V blocks in flight: 2 × 2 × 64 × 128 × 2 bytes = 64 KiB shared memory at D=128 bf16

# Split heuristic: two programs per SM of an H100/H200 (132 SMs; at B = 256 one split, measured
# faster than two: benchmarks/RESULTS.md), and the shortest chunk worth a split
# (a split costs a [G, D] fp32 partial written and read back, ~10% of a 128-key chunk's K/V at G=6).
TARGET_PROGRAMS = 2 * 132
MIN_CHUNK = 128
MAX_SPLITS = 64

LOG2E = 1.0 / math.log(2.0)


def split_plan(batch: int, kv_heads: int, key_len: int, num_splits: int | None = None) -> tuple[int, int]:
    """(splits, chunk): the keys [0, key_len) cut into `splits` chunks of `chunk` keys (the last may be shorter).

    A pure function of the shape, so CUDA-graph safe. Automatic choice: enough programs
    (batch · kv_heads · splits ≈ TARGET_PROGRAMS) to fill the SMs, but no chunk shorter than
    MIN_CHUNK keys and at most MAX_SPLITS; chunks are whole BLOCK_N blocks. A forced `num_splits`
    gives chunks of ceil(key_len / num_splits) keys. Either way the count is recomputed from the
    chunk, so no chunk starts past key_len (10 keys in 6 splits: chunks of 2, 5 splits).
    """
    if num_splits is None:
        wanted = triton.cdiv(TARGET_PROGRAMS, batch * kv_heads)
        splits = max(1, min(wanted, key_len // MIN_CHUNK, MAX_SPLITS))
        chunk = triton.cdiv(triton.cdiv(key_len, splits), BLOCK_N) * BLOCK_N
    elif 1 <= num_splits <= key_len:
        chunk = triton.cdiv(key_len, num_splits)
    else:
        raise ValueError(f"num_splits must be in [1, key_len={key_len}], got {num_splits}")
    return triton.cdiv(key_len, chunk), chunk


@triton.jit
def attend_chunk(q, k_base, v_base, start, end, stride_kn, stride_vn, qk_scale, ROWS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Softmax attention of the query rows q [ROWS, BLOCK_D] over keys [start, end) of one (slot, KV head):
    (o = acc / l [ROWS, BLOCK_D], lse = m + log2 l [ROWS]) in fp32; an empty range gives o = 0, lse = -inf."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        # K^T block [D, N]: the scores are one [ROWS, D] @ [D, N] matmul.
        k = tl.load(k_base + n[None, :] * stride_kn + offs_d[:, None],
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Key n0 is valid, so every row's new max is finite and the rescale factor is never NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _split_kernel(Q, K, V, Lengths, Starts, Slots, MidO, MidLse, qk_scale, key_len, chunk,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HAS_STARTS: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(Slots + b).to(tl.int64)  # slot · stride_kb can pass 2**31 in a large cache
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    # Padded head rows load zeros: their scores are 0, harmless, and they are never stored.
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    length = tl.minimum(tl.load(Lengths + b).to(tl.int32), key_len)  # never read past key_len
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    if HAS_STARTS:  # the row's keys begin at Starts[b] (those before are read elsewhere: a shared prefix)
        start = tl.maximum(start, tl.load(Starts + b).to(tl.int32))

    k_base = K + slot * stride_kb + kv_head * stride_kh
    v_base = V + slot * stride_vb + kv_head * stride_vh
    o, lse = attend_chunk(q, k_base, v_base, start, end, stride_kn, stride_vn, qk_scale,
                          ROWS=BLOCK_G, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PRECISION=PRECISION)
    o_ptrs = MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o.to(MidO.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _combine_kernel(MidO, MidLse, Out, num_splits,
                    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_yb, stride_yh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    lse_ptrs = MidLse + b * stride_lb + heads * stride_lh

    lse = tl.load(lse_ptrs[:, None] + offs_s[None, :], mask=g_mask[:, None] & (offs_s < num_splits)[None, :],
                  other=float("-inf"))
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: every weight is 0, the output 0
    total = tl.sum(tl.exp2(lse - top[:, None]), axis=1)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for split in range(num_splits):
        split_lse = tl.load(lse_ptrs + split, mask=g_mask, other=float("-inf"))
        w = tl.exp2(split_lse - top)
        # A split without keys weighs 0 and its o is not read: it may never have been written.
        o = tl.load(MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
                    mask=(g_mask & (split_lse > float("-inf")))[:, None] & d_mask[None, :], other=0.0)
        acc += w[:, None] * o
    y = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(Out + b * stride_yb + heads[:, None] * stride_yh + offs_d[None, :], y.to(Out.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])


# Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run in numpy on CPU tensors.
INTERPRETED = not isinstance(_split_kernel, JITFunction)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     key_len: int, slots: torch.Tensor | None = None, scale: float | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """q [B, H, D]: one query token per row; k_cache, v_cache [S, Hkv, L, D]; slots [B] int: the cache slot row i
    reads (default: slot i, then S >= B); lengths [B] int: row i attends to keys [0, lengths[i]) of its slot
    (1 <= lengths[i] <= key_len);
    key_len: static upper bound (a Python int, <= L) on lengths: the kernel never reads beyond it, and grid/split
    sizes depend only on (B, H, Hkv, D, key_len) so the call can be captured in a CUDA graph (no host sync, no
    .item(), no data-dependent shapes). Returns [B, H, D] in q's dtype. H must be a multiple of Hkv (GQA: query head h
    uses KV head h // (H // Hkv), as transformers' repeat_kv does). scale defaults to D ** -0.5.

    num_splits overrides the automatic choice of split_plan (tests, tuning).
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, H, D] and k_cache, v_cache [S, Hkv, L, D] of one shape; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    B, H, D = q.shape
    S, kv_heads, L, Dk = k_cache.shape
    if slots is None:
        if S < B:
            raise ValueError(f"{B} rows read slots 0..{B - 1}, but the cache has {S}; pass slots=")
        slots = torch.arange(B, device=q.device)
    if Dk != D or H % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}: need the same head_dim "
                         f"and H a multiple of Hkv")
    if slots.shape != (B,) or slots.device != q.device:
        raise ValueError(f"slots must be [B] = [{B}] on q's device, got {tuple(slots.shape)} on {slots.device}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not 1 <= key_len <= L:
        raise ValueError(f"key_len must be in [1, {L}] (the cache length), got {key_len}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got {tuple(lengths.shape)}")
    if not q.device == k_cache.device == v_cache.device == lengths.device:
        raise ValueError(f"q, k_cache, v_cache and lengths must be on one device; got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}, {lengths.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension; got strides {t.stride()}")
    if not INTERPRETED and q.device.type != "cuda":
        raise ValueError("decode_attention needs CUDA tensors (or TRITON_INTERPRET=1 set before importing it)")
    num_splits, chunk = split_plan(B, kv_heads, key_len, num_splits)
    scale = D ** -0.5 if scale is None else scale

    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    if num_splits == 1:  # acc / l of the only split is the answer: stage 1 writes it, no stage 2
        mid_o, o_strides = out, (out.stride(0), out.stride(1), 0)
    else:
        mid_o = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
        o_strides = mid_o.stride()[:3]
    launch_splits(q, k_cache, v_cache, lengths, slots, mid_o, o_strides, mid_lse, scale, key_len, num_splits, chunk)
    if num_splits > 1:
        launch_combine(mid_o, mid_lse, out, num_splits, kv_heads)
    return out


def launch_splits(q, k_cache, v_cache, lengths, slots, mid_o, o_strides, mid_lse, scale, key_len, num_splits, chunk,
                  starts=None) -> None:
    """Stage 1 over grid (B, Hkv, num_splits): each chunk's (o, lse) per query head into mid_o / mid_lse, split s
    at [:, :, s]; with `starts`, row b reads keys [starts[b], lengths[b]) only."""
    B, H, D = q.shape
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    _split_kernel[(B, kv_heads, num_splits)](
        q, k_cache, v_cache, lengths, lengths if starts is None else starts, slots, mid_o, mid_lse,
        scale * LOG2E, key_len, chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *o_strides, mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=D, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_STARTS=starts is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def launch_combine(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                   kv_heads: int) -> None:
    """Stage 2 over grid (B, Hkv): out = the lse-weighted mean of the splits' o (fp32 mid_o [B, H, splits, D])."""
    B, H, D = out.shape
    group = H // kv_heads
    _combine_kernel[(B, kv_heads)](
        mid_o, mid_lse, out, num_splits, *mid_o.stride()[:3], mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=D, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
