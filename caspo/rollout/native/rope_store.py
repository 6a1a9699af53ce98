"""RoPE and the KV-cache write in one Triton kernel: the fused q/k/v projection in, rotated q out, k and v
stored straight into their cache slots.

For a token at position p of slot s, with qkv = [q heads | k heads | v heads] (each head D wide, halves a, b):

    rotated(a, b) = (a·cos_p[:D/2] − b·sin_p[:D/2],  b·cos_p[D/2:] + a·sin_p[D/2:])    (transformers' RoPE)
    q_out[token, h] = rotated(q_h);   cache_k[s, h, p] = rotated(k_h);   cache_v[s, h, p] = v_h

Every product and sum is rounded to the compute dtype as eager bf16 does (`runner.rotary_split` and
two index_put writes), so the cache holds the same numbers. Eager, or compiled, those writes were
the largest element-wise cost of a decode step (about 9 µs a layer at 256 rows on an H200: each
advanced-index write is a few kernels); here a layer's RoPE and writes are one launch.

One program a token, all its heads in one tile: a prefill forward of 8,192 tokens is 8,192 programs. With one
one-warp program a head it was 131,072, which moved the layer's 67 MB at 0.9 TB/s on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

WARPS = 4  # a token's [16 heads, 64] tile at Qwen2.5-1.5B's shape: 8 entries a lane for each half


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE, to nearest even, and held in float32."""
    if DTYPE == tl.bfloat16:  # on the bits: triton's CPU interpreter truncates a bfloat16 cast
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def rotated_half(x, partner, cos, sin, sign, DTYPE: tl.constexpr):
    """One half of a rotated head, x·cos + sign·partner·sin (sign −1 on the first half, +1 on the second), with
    each product and the sum rounded to DTYPE as eager does: the numbers of both RoPE kernels (float32 in/out)."""
    return rounded(rounded(x * cos, DTYPE) + sign * rounded(partner * sin, DTYPE), DTYPE)


@triton.jit
def _rope_store_kernel(QKV, Cos, Sin, Positions, Slots, Q, CacheK, CacheV, tokens_per_row,
                       stride_qkv, stride_q_token, stride_q_head, stride_slot, stride_head, stride_pos,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK: tl.constexpr):
    # One program a token, its heads the rows of a [BLOCK_H, BLOCK] tile of half-heads: q heads, k heads, v heads.
    token = tl.program_id(0)
    dtype = QKV.dtype.element_ty
    head = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (head < HEADS + 2 * KV_HEADS) & (offs < HALF)
    position = tl.load(Positions + token).to(tl.int64)
    src = QKV + token * stride_qkv + head * 2 * HALF + offs
    a = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(src + HALF, mask=inside, other=0.0).to(tl.float32)
    table = position * 2 * HALF + offs
    cos_a = tl.load(Cos + table, mask=offs < HALF, other=0.0).to(tl.float32)
    cos_b = tl.load(Cos + table + HALF, mask=offs < HALF, other=0.0).to(tl.float32)
    sin_a = tl.load(Sin + table, mask=offs < HALF, other=0.0).to(tl.float32)
    sin_b = tl.load(Sin + table + HALF, mask=offs < HALF, other=0.0).to(tl.float32)
    rotate = head < HEADS + KV_HEADS  # q and k rotate; v is stored as it came
    a, b = (tl.where(rotate, rotated_half(a, b, cos_a, sin_a, -1.0, dtype), a),
            tl.where(rotate, rotated_half(b, a, cos_b, sin_b, 1.0, dtype), b))
    a, b = a.to(dtype), b.to(dtype)

    is_q = head < HEADS
    q_dst = Q + token * stride_q_token + head * stride_q_head + offs
    tl.store(q_dst, a, mask=inside & is_q)
    tl.store(q_dst + HALF, b, mask=inside & is_q)
    slot = tl.load(Slots + token // tokens_per_row).to(tl.int64)
    kv_head = tl.where(rotate, head - HEADS, head - HEADS - KV_HEADS)  # masked lanes never store
    kv_dst = slot * stride_slot + kv_head * stride_head + position * stride_pos + offs
    is_k = (~is_q) & rotate
    tl.store(CacheK + kv_dst, a, mask=inside & is_k)
    tl.store(CacheK + kv_dst + HALF, b, mask=inside & is_k)
    is_v = ~rotate
    tl.store(CacheV + kv_dst, a, mask=inside & is_v)
    tl.store(CacheV + kv_dst + HALF, b, mask=inside & is_v)


# Under TRITON_INTERPRET=1 (set before this module is imported) the kernel runs in numpy on CPU tensors.
INTERPRETED = not isinstance(_rope_store_kernel, JITFunction)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               cache_k: torch.Tensor, cache_v: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotated q [B, T, heads, D] of qkv [B, T, (heads + 2·kv_heads)·D]; rotated k and v written to
    cache_k, cache_v [slots, kv_heads, L, D] at (slots[b], :, positions[b, t]). cos, sin: [max positions, D]
    tables in qkv's dtype; positions [B, T] and slots [B] integer tensors on qkv's device."""
    B, T, width = qkv.shape
    kv_heads, D = cache_k.shape[1], cache_k.shape[3]
    if width != (heads + 2 * kv_heads) * D or cache_v.shape != cache_k.shape or D % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {heads} query heads and the cache "
                         f"{tuple(cache_k.shape)} (even head_dim, k and v of one shape)")
    if not qkv.dtype == cos.dtype == sin.dtype == cache_k.dtype == cache_v.dtype:
        raise ValueError(f"rope_store needs one dtype for qkv, the tables and the caches; got {qkv.dtype}, "
                         f"{cos.dtype}, {sin.dtype}, {cache_k.dtype}, {cache_v.dtype}")
    if qkv.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride() != cache_k.stride():
        raise ValueError("rope_store needs qkv and the caches contiguous in their last dimension, k and v alike")
    if not INTERPRETED and qkv.device.type != "cuda":
        raise ValueError("rope_store needs CUDA tensors (or TRITON_INTERPRET=1 set before importing it)")
    q = torch.empty(B, T, heads, D, dtype=qkv.dtype, device=qkv.device)
    tokens = qkv.reshape(B * T, width)
    _rope_store_kernel[(B * T,)](
        tokens, cos.contiguous(), sin.contiguous(), positions.reshape(-1).contiguous(), slots.contiguous(), q,
        cache_k, cache_v, T, tokens.stride(0), q.stride(2) * heads, q.stride(2), cache_k.stride(0),
        cache_k.stride(1), cache_k.stride(2), HEADS=heads, KV_HEADS=kv_heads, HALF=D // 2,
        BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads), BLOCK=triton.next_power_of_2(D // 2), num_warps=WARPS,
        enable_fp_fusion=False)  # no FMA: eager rounds each product
    return q
