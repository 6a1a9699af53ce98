"""Decode attention with RoPE and the K/V-cache write in its prologue: one launch a layer instead of two.

For one query token per row, qkv [B, (H + 2·Hkv)·D] straight from the fused projection, program (b, j) of
grid (B, Hkv):

    1. rotates the G = H / Hkv query heads of KV head j and that head's key as `rope_store` does (each product
       and sum rounded to the compute dtype), and writes the key and the value into slot slots[b] at
       positions[b];
    2. attends over keys [0, lengths[b]) of the slot as `decode_attention`'s single split does, the key just
       written included.

The output, and the cache, equal `rope_store` followed by `decode_attention` bit for bit.

Only where one program reads a row's whole key range, that is where `split_plan` gives one split (at two KV
heads, every batch of 132 rows or more, and every batch whose key range is shorter than 256): with several splits a
program of another split could read the new key before it is written. And only in bf16 / fp16: in float32 the
rotation's products could be contracted into FMAs, which `rope_store`, compiled without contraction, never
makes. Elsewhere `rope_decode_attention` runs the two kernels, which compute the same numbers.

Why: at 256 rows a decode step's `rope_store` launch was about 4.5 µs a layer on an H200, 3% of the step, for
a kernel that reads and writes a few kilobytes. Without it the top-p 1.0 rollout on an H100 went from 62.6 k to
64.0–64.4 k tokens/s (benchmarks/RESULTS.md, fifteenth series).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from caspo.rollout.native.decode_attention import (
    BLOCK_N,
    INTERPRETED,
    LOG2E,
    NUM_STAGES,
    NUM_WARPS,
    attend_chunk,
    decode_attention,
    split_plan,
)
from caspo.rollout.native.rope_store import rope_store, rotated_half


@triton.jit
def _rope_attend_kernel(QKV, Cos, Sin, Positions, Lengths, Slots, CacheK, CacheV, Out, qk_scale, key_len,
                        stride_qkv, stride_table, stride_kb, stride_kh, stride_kn, stride_ob, stride_oh,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    dtype = QKV.dtype.element_ty
    # Every load that needs no other is issued first, in one round trip to memory: the row's slot, position and
    # length, and its q, k and v. Only the tables wait for the position, and the first K/V block for the store.
    slot = tl.load(Slots + b).to(tl.int64)  # slot · stride_kb can pass 2**31 in a large cache
    position = tl.load(Positions + b).to(tl.int64)
    length = tl.minimum(tl.load(Lengths + b).to(tl.int32), key_len)  # never read past key_len

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    first_half = offs_d < HEAD_DIM // 2
    partner = tl.where(first_half, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
    sign = tl.where(first_half, -1.0, 1.0)

    row = QKV + b * stride_qkv
    q_cols = row + heads[:, None] * HEAD_DIM
    k_cols = row + (HEADS + kv_head) * HEAD_DIM
    # Padded head rows load zeros and rotate them: their scores are 0, harmless, and they are never stored.
    q_x = tl.load(q_cols + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q_partner = tl.load(q_cols + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    k_x = tl.load(k_cols + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    k_partner = tl.load(k_cols + partner, mask=d_mask, other=0.0).to(tl.float32)
    v = tl.load(row + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + offs_d, mask=d_mask)

    cos = tl.load(Cos + position * stride_table + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + position * stride_table + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q = rotated_half(q_x, q_partner, cos[None, :], sin[None, :], sign[None, :], dtype)
    k = rotated_half(k_x, k_partner, cos, sin, sign, dtype)

    k_base = CacheK + slot * stride_kb + kv_head * stride_kh
    v_base = CacheV + slot * stride_kb + kv_head * stride_kh
    tl.store(k_base + position * stride_kn + offs_d, k.to(dtype), mask=d_mask)
    tl.store(v_base + position * stride_kn + offs_d, v, mask=d_mask)
    tl.debug_barrier()  # every thread's loads below see the key and value just written

    o, _ = attend_chunk(q.to(dtype), k_base, v_base, 0, length, stride_kn, stride_kn, qk_scale,
                        ROWS=BLOCK_G, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PRECISION=PRECISION)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(dtype), mask=q_mask)


def fuses(dtype: torch.dtype, batch: int, kv_heads: int, key_len: int) -> bool:
    """Whether `rope_decode_attention` runs as one kernel at this shape (see the module's docstring)."""
    return dtype in (torch.bfloat16, torch.float16) and split_plan(batch, kv_heads, key_len)[0] == 1


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          lengths: torch.Tensor, slots: torch.Tensor, key_len: int, cache_k: torch.Tensor,
                          cache_v: torch.Tensor, heads: int) -> torch.Tensor:
    """`decode_attention(rope_store(qkv, ...)[:, 0], cache_k, cache_v, lengths, key_len, slots)`: attention
    [B, heads, D] of qkv [B, (heads + 2·kv_heads)·D], one token per row at positions [B] of slots [B] (each
    row's rotated key and value written there first); cos, sin [max positions, D] tables in qkv's dtype."""
    B, width = qkv.shape
    kv_heads, D = cache_k.shape[1], cache_k.shape[3]
    if not fuses(qkv.dtype, B, kv_heads, key_len):
        q = rope_store(qkv[:, None], cos, sin, positions[:, None], slots, cache_k, cache_v, heads)
        return decode_attention(q[:, 0], cache_k, cache_v, lengths, key_len, slots)
    if width != (heads + 2 * kv_heads) * D or cache_v.stride() != cache_k.stride() or heads % kv_heads or D % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {heads} query heads and the cache "
                         f"{tuple(cache_k.shape)} (k and v alike, heads a multiple of the KV heads, an even head_dim)")
    if qkv.stride(-1) != 1 or cache_k.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("rope_decode_attention needs qkv, the caches and the tables contiguous in their last "
                         "dimension")
    if not qkv.dtype == cos.dtype == sin.dtype == cache_k.dtype == cache_v.dtype:
        raise ValueError(f"rope_decode_attention needs one dtype for qkv, the tables and the caches; got {qkv.dtype}, "
                         f"{cos.dtype}, {sin.dtype}, {cache_k.dtype}, {cache_v.dtype}")
    if not 1 <= key_len <= cache_k.shape[2]:
        raise ValueError(f"key_len must be in [1, {cache_k.shape[2]}] (the cache length), got {key_len}")
    if not INTERPRETED and qkv.device.type != "cuda":
        raise ValueError("rope_decode_attention needs CUDA tensors (or TRITON_INTERPRET=1 set before importing it)")
    out = torch.empty(B, heads, D, dtype=qkv.dtype, device=qkv.device)
    group = heads // kv_heads
    _rope_attend_kernel[(B, kv_heads)](
        qkv, cos, sin, positions.contiguous(), lengths.contiguous(), slots.contiguous(), cache_k, cache_v, out,
        D ** -0.5 * LOG2E, key_len,
        qkv.stride(0), cos.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), out.stride(0),
        out.stride(1), HEADS=heads, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=D,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_N,
        PRECISION="tf32", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
