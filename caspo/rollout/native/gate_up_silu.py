"""The gate/up projection of a decode step with SiLU·up in the GEMM's epilogue: one launch a layer instead of two.

For x [rows, hidden] and the fused weight [gate; up] [2 · inter, hidden] (`linears.fuse_linears`), each program
keeps a gate and an up accumulator for the same block of columns, so

    out[m, n] = silu(x[m] · gate[n]) · (x[m] · up[n])

is formed before anything is written: [rows, inter] leaves the kernel where cuBLAS wrote [rows, 2 · inter] for
`runner.silu_mul` to read back. Rounded as the engine rounds: each accumulator to the compute dtype (a GEMM's
output), SiLU in float32 rounded to it, and the product rounded to it. What differs from cuBLAS + `silu_mul` is
the GEMM's summation order alone.

Why: `silu_mul` only reads the GEMM's output back, yet costs 1.7-5.8 µs of a layer at 16-256 rows on an H100. Where
the Triton GEMM keeps up with cuBLAS's is measured per decode size (`benchmarks/gate_up_silu_bench.py`): on an
H100 it does at 2-128 rows, where the GEMM is bound by reading the weight, and at some larger sizes, but not at
256 (benchmarks/RESULTS.md, thirty-fourth series). `linears.GATE_UP_CONFIGS` lists the sizes where it won, and
`MLP.deferred` takes it only there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from caspo.rollout.native.linears import GateUpConfig


@triton.jit
def _silu_mul_epilogue(acc_gate, acc_up, dtype: tl.constexpr):
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    return (silu.to(tl.float32) * up).to(dtype)


@triton.jit
def _gate_up_silu_kernel(X, W, Out, rows, depth, inter, stride_x, stride_w, stride_o,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)  # the row tiles of one column block run side by side
    n = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        kk = k0 + k
        a = tl.load(X + m[:, None] * stride_x + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < depth),
                    other=0.0)
        w_mask = (n[None, :] < inter) & (kk[:, None] < depth)
        w_gate = tl.load(W + n[None, :] * stride_w + kk[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(W + (inter + n[None, :]) * stride_w + kk[:, None], mask=w_mask, other=0.0)
        acc_gate += tl.dot(a, w_gate)
        acc_up += tl.dot(a, w_up)
    out = _silu_mul_epilogue(acc_gate, acc_up, Out.dtype.element_ty)
    tl.store(Out + m[:, None] * stride_o + n[None, :], out, mask=(m[:, None] < rows) & (n[None, :] < inter))


@triton.jit
def _gate_up_silu_tma_kernel(x_desc, w_desc, out_desc, rows, depth, inter,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_gate_up_silu_kernel` with its tiles moved by the tensor memory accelerator (out-of-range reads are 0)."""
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    off_m = (tile % tiles_m) * BLOCK_M
    off_n = (tile // tiles_m) * BLOCK_N
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        a = x_desc.load([off_m, k0])
        acc_gate += tl.dot(a, w_desc.load([off_n, k0]).T)
        acc_up += tl.dot(a, w_desc.load([inter + off_n, k0]).T)
    out_desc.store([off_m, off_n], _silu_mul_epilogue(acc_gate, acc_up, out_desc.dtype))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GateUpConfig) -> torch.Tensor:
    """silu(x Wgᵀ) · (x Wuᵀ) [rows, inter] for x [rows, hidden] and weight = [Wg; Wu] [2 · inter, hidden], in x's
    dtype, launched as `config` says."""
    block_m, block_n, block_k, warps, stages, tma = config
    rows, depth = x.shape
    inter = weight.shape[0] // 2
    if weight.shape != (2 * inter, depth):
        raise ValueError(f"weight {tuple(weight.shape)} is not [gate; up] over the {depth} features of x")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gate_up_silu needs x and the weight contiguous in their last dimension")
    if tma and inter % block_n:  # a gate tile would run into the up rows
        raise ValueError(f"tensor descriptors need the {inter} columns of each half in whole tiles of {block_n}")
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(inter, block_n),)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # triton 3.4 and later

        _gate_up_silu_tma_kernel[grid](TensorDescriptor.from_tensor(x, [block_m, block_k]),
                                       TensorDescriptor.from_tensor(weight, [block_n, block_k]),
                                       TensorDescriptor.from_tensor(out, [block_m, block_n]), rows, depth, inter,
                                       **launch)
    else:
        _gate_up_silu_kernel[grid](x, weight, out, rows, depth, inter, x.stride(0), weight.stride(0), out.stride(0),
                                   **launch)
    return out
