"""Decode attention that reads a prefix held by several rows once for all of them, in Triton.

The K continuations of one Monte Carlo prefix (and the G samples of one prompt) hold byte-identical
copies of their prompt's K/V: prefix sharing copies it into each slot (`KVCache.copy_prefix`). The
split-K kernel (`decode_attention`) reads every row's own copy, K times the bytes of the prefix. Here
the rows of a group read it once:

    prefix stage, grid (Hkv, groups, Sp): program (j, g, s) loads chunk s of keys [0, P_g) from one slot
        of group g and scores it against the queries of all the group's rows at once (up to `members`
        rows × G query heads: one [rows·G, D] @ [D, N] matmul), writing each row's (o, lse) as split s;
    suffix stage: decode_attention's split kernel over keys [P_g, length) of each row's own slot,
        written as splits Sp, Sp + 1, ...;
    combine: decode_attention's stage 2 over all the splits of a row. A split nobody wrote (the prefix
        splits of a row in no group) keeps lse = -inf and weighs 0; its o is never read.

The same softmax as `decode_attention`, summed in another order. A row in no group reads its keys from
0 in the suffix stage. Group tensors have static shapes and the count of groups in use is read on the
device, so a call can be captured in a CUDA graph; programs of groups past the count do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from caspo.rollout.native.decode_attention import (
    LOG2E,
    NUM_STAGES,
    attend_chunk,
    launch_combine,
    launch_splits,
    split_plan,
)
from caspo.rollout.native.prefix_groups import QUERY_VECTORS, PrefixGroups

# At the Qwen2.5-1.5B shape (64 query vectors of 128), 4 warps over blocks of 32 keys need 244 registers a thread
# and do not spill (sm_90; tests/test_kernel_builds.py), so two programs fit an SM; on an H200 they beat 8 warps
# over 64 keys by 10% (benchmarks/shared_prefix_bench.py). Module constants, so that the benchmark can tune them.
PREFIX_WARPS = 4
PREFIX_BLOCK_N = 32


@triton.jit
def _prefix_kernel(Q, K, V, Members, Slots, Lengths, Count, MidO, MidLse, qk_scale, chunk,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_mg,
                   GROUP: tl.constexpr, MEMBERS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # The KV head first: the grid holds an entry for every group a step could have, most of them past the count
    # in use, and this way the card schedules the programs of the groups in use first.
    kv_head = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    used = g < tl.load(Count)  # entries past the groups in use are stale: they count as empty groups
    prefix = tl.where(used, tl.load(Lengths + g), 0).to(tl.int32)
    slot = tl.load(Slots + g).to(tl.int64)

    # Query vector i is head kv_head·G + i % G of member i // G.
    offs_q = tl.arange(0, BLOCK_Q)
    member = offs_q // GROUP
    row = tl.load(Members + g * stride_mg + member, mask=member < tl.where(used, MEMBERS, 0), other=-1).to(tl.int64)
    valid = row >= 0
    heads = kv_head * GROUP + offs_q % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + row[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)

    start = split * chunk
    end = tl.minimum(start + chunk, prefix)
    o, lse = attend_chunk(q, K + slot * stride_kb + kv_head * stride_kh, V + slot * stride_vb + kv_head * stride_vh,
                          start, end, stride_kn, stride_vn, qk_scale, ROWS=BLOCK_Q, HEAD_DIM=HEAD_DIM,
                          BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PRECISION=PRECISION)
    tl.store(MidO + row[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :], o,
             mask=valid[:, None] & d_mask[None, :])
    tl.store(MidLse + row * stride_lb + heads * stride_lh + split, lse, mask=valid)


def shared_prefix_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   lengths: torch.Tensor, key_len: int, slots: torch.Tensor, groups: PrefixGroups,
                                   scale: float | None = None, prefix_chunk: int | None = None) -> torch.Tensor:
    """`decode_attention(q, k_cache, v_cache, lengths, key_len, slots)`, each group's prefix read once.

    q [B, H, D]; k_cache, v_cache [S, Hkv, L, D]; lengths, slots [B]; key_len a Python int bounding lengths.
    The members of a group must hold the same K/V at keys [0, P) of their slots, and P < their lengths.
    prefix_chunk: keys per prefix program (tuning); by default split_plan's choice for the group entries.
    """
    B, H, D = q.shape
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    if groups.starts.shape != (B,) or groups.members.dim() != 2 or groups.members.shape[1] > QUERY_VECTORS // group:
        raise ValueError(f"groups do not fit {B} rows of {group} heads a KV head: starts {tuple(groups.starts.shape)}, "
                         f"members {tuple(groups.members.shape)} (at most {QUERY_VECTORS // group} a group)")
    scale = D ** -0.5 if scale is None else scale
    num_groups = groups.members.shape[0]
    if prefix_chunk is None:
        prefix_splits, prefix_chunk = split_plan(num_groups, kv_heads, key_len)
    else:
        prefix_splits = triton.cdiv(key_len, prefix_chunk)
    suffix_splits, suffix_chunk = split_plan(B, kv_heads, key_len)
    # The combine reads every split's lse, and the o of those with keys: a row in no group leaves its prefix
    # splits at lse = -inf.
    mid_o = torch.empty(B, H, prefix_splits + suffix_splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.full((B, H, prefix_splits + suffix_splits), float("-inf"), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    _prefix_kernel[(kv_heads, num_groups, prefix_splits)](
        q, k_cache, v_cache, groups.members, groups.slots, groups.lengths, groups.count, mid_o, mid_lse, scale * LOG2E,
        prefix_chunk, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *mid_o.stride()[:3], mid_lse.stride(0),
        mid_lse.stride(1), groups.members.stride(0),
        GROUP=group, MEMBERS=groups.members.shape[1], HEAD_DIM=D, BLOCK_Q=max(16, triton.next_power_of_2(
            groups.members.shape[1] * group)), BLOCK_D=block_d, BLOCK_N=PREFIX_BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=PREFIX_WARPS, num_stages=NUM_STAGES)
    suffix_o = mid_o[:, :, prefix_splits:]
    launch_splits(q, k_cache, v_cache, lengths, slots, suffix_o, suffix_o.stride()[:3],
                  mid_lse[:, :, prefix_splits:], scale, key_len, suffix_splits, suffix_chunk, starts=groups.starts)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    launch_combine(mid_o, mid_lse, out, prefix_splits + suffix_splits, kv_heads)
    return out
