"""A decode step's down (and output) projection split over K, with the residual add and the next RMSNorm taking
the partials, against one cuBLAS GEMM (which splits K itself for these skinny shapes, then reduces in a kernel
of its own) followed by the engine's compiled `add_rms_norm`.

At 256 rows the down projection's 256 × 1,536 output has 24 tiles of 128 × 128 for 132 SMs, so the K
dimension (8,960) must be split to fill the card. Two ways of writing the float32 partials are timed:

- `cublas-partials-S`, what the engine runs at a decode step's rows (`linears.split_linear`): one cuBLAS
  strided-batched GEMM over S spans of K with float32 outputs, summed by the compiled `add_rms_norm`;
- the Triton GEMM of each configuration in CONFIGS, each program summing one span of K for one tile, and one
  program per row adding the partials, rounding the sum to the activations' dtype (as a GEMM's output is
  rounded), adding it to the residual stream and normalising the result (`--configs none` skips them).

`silu-down` also takes the gate/up projection's output as it is: the Triton GEMM applies SiLU·up as its tiles
load, in place of the engine's `silu_mul` kernel and its write of the intermediate. Each variant is timed as
CUDA-graph replays cycling over --copies weight copies (weights from HBM, as in a step), with the largest
difference from the one-GEMM path's outputs. CUDA only; tests/test_split_k_bench.py checks the Triton kernels in
Triton's interpreter.

    python benchmarks/split_k_bench.py --rows 256,960 --out benchmarks/results.jsonl --commit $COMMIT
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (rows a tile, columns a tile, K a loop step, splits of K, warps, pipeline stages)
CONFIGS = [(128, 128, 64, 4, 8, 4), (128, 128, 64, 6, 8, 4), (128, 128, 64, 8, 8, 3), (128, 128, 128, 5, 8, 3),
           (64, 128, 64, 3, 4, 4), (64, 128, 64, 4, 4, 4), (64, 128, 128, 3, 4, 3), (128, 64, 64, 3, 4, 4),
           (64, 64, 64, 2, 4, 4), (64, 64, 128, 2, 4, 3)]


@triton.jit
def _partials_kernel(X, W, Partials, rows, cols, depth, stride_x, stride_w, k_span,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """Partials[split, m, n] = Σ_{k in split's span} A[m, k] · W[n, k], in float32, where A = X, or with GATED
    A = silu(X[:, :depth]) · X[:, depth:] rounded as the engine's `silu_mul` rounds, computed as its tiles load."""
    tile, split = tl.program_id(0), tl.program_id(1)
    tiles_n = tl.cdiv(cols, BLOCK_N)
    m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = split * k_span
    for k0 in range(start, tl.minimum(start + k_span, depth), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        inside = (m[:, None] < rows) & (k[None, :] < depth)
        a = tl.load(X + m[:, None] * stride_x + k[None, :], mask=inside, other=0.0)
        if GATED:
            up = tl.load(X + m[:, None] * stride_x + depth + k[None, :], mask=inside, other=0.0).to(tl.float32)
            gate = a.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(a.dtype)
            a = (silu.to(tl.float32) * up).to(a.dtype)
        b = tl.load(W + n[None, :] * stride_w + k[:, None], mask=(n[None, :] < cols) & (k[:, None] < depth),
                    other=0.0)
        acc += tl.dot(a, b)
    tl.store(Partials + (split * rows + m[:, None]) * cols + n[None, :], acc,
             mask=(m[:, None] < rows) & (n[None, :] < cols))


@triton.jit
def _reduce_add_norm_kernel(Partials, Residual, Weight, Out, Normed, rows, cols, eps,
                            SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Out = Residual + round(Σ_split Partials); Normed = Weight · round(Out / rms(Out)), as `_rms_norm` rounds."""
    row = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    inside = n < cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(Partials + (split * rows + row) * cols + n, mask=inside, other=0.0)
    dtype = Residual.dtype.element_ty
    x = (tl.load(Residual + row * cols + n, mask=inside, other=0.0).to(tl.float32)
         + acc.to(dtype).to(tl.float32)).to(dtype)
    xf = x.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / cols + eps)
    normed = (xf * inverse_rms).to(dtype)
    weight = tl.load(Weight + n, mask=inside, other=0.0)
    tl.store(Out + row * cols + n, x, mask=inside)
    tl.store(Normed + row * cols + n, (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=inside)


def split_k_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, config: tuple = CONFIGS[0],
                         gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x Wᵀ, rms_norm(residual + x Wᵀ)) with the GEMM split over K, as the engine's
    `add_rms_norm(residual, F.linear(x, weight), norm_weight, eps)` gives them up to the GEMM's summation order.
    gated: x is the gate/up projection's output and the GEMM's input is `silu_mul(x)`, never written out."""
    block_m, block_n, block_k, splits, warps, stages = config
    rows, cols = x.shape[0], weight.shape[0]
    depth = x.shape[1] // 2 if gated else x.shape[1]
    if weight.shape[1] != depth:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of {depth} features")
    k_span = triton.cdiv(triton.cdiv(depth, splits), block_k) * block_k
    splits = triton.cdiv(depth, k_span)  # no empty split
    partials = torch.empty(splits, rows, cols, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)
    _partials_kernel[(tiles, splits)](x, weight, partials, rows, cols, depth, x.stride(0), weight.stride(0), k_span,
                                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
                                      num_warps=warps, num_stages=stages)
    out, normed = torch.empty_like(residual), torch.empty_like(residual)
    _reduce_add_norm_kernel[(rows,)](partials, residual, norm_weight, out, normed, rows, cols, eps, SPLITS=splits,
                                     BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols > 1024 else 4)
    return out, normed


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _common import add_graph_timing_args, append_result, kernel_record, print_table
    from decode_attention_bench import graph_ms

    from caspo.rollout.native.linears import spans_fit, split_linear
    from caspo.rollout.native.runner import add_rms_norm, silu_mul

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,960", help="rows of a decode step, comma-separated")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--gemms", default="down,silu-down,o",
                        help="down (intermediate -> hidden), silu-down (gate/up -> silu_mul -> down), "
                             "o (hidden -> hidden)")
    parser.add_argument("--configs", default="all", help="'all' of CONFIGS, or 'none'")
    parser.add_argument("--cublas-splits", default="2,3,4,5,6,7,8",
                        help="spans of K for the cuBLAS partials (those the engine could take: `linears.spans_fit`)")
    add_graph_timing_args(parser)
    args = parser.parse_args()
    record = kernel_record("split_k", args.commit)
    configs = CONFIGS if args.configs == "all" else []
    cublas_splits = [int(s) for s in args.cublas_splits.split(",") if s]
    torch.manual_seed(0)
    # name -> (input features, gated): silu-down takes the gate/up output and applies silu_mul as it loads
    gemms = {"down": (args.intermediate, False), "silu-down": (2 * args.intermediate, True), "o": (args.hidden, False)}
    eps, table = 1e-6, []
    for m in (int(r) for r in args.rows.split(",")):
        for gemm in args.gemms.split(","):
            (k, gated), n = gemms[gemm], args.hidden
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            norm_weight = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
            depth = k // 2 if gated else k
            weights = [torch.randn(n, depth, device="cuda", dtype=torch.bfloat16) * depth ** -0.5
                       for _ in range(args.copies)]

            def one_gemm(i, x=x, residual=residual, norm_weight=norm_weight, weights=weights, gated=gated):
                return add_rms_norm(residual, F.linear(silu_mul(x) if gated else x, weights[i]), norm_weight, eps)

            want = one_gemm(0)
            one_gemm_ms = graph_ms(one_gemm, args.copies, args.calls, args.replays)
            rows = [[("silu_mul + " if gated else "") + "cuBLAS + add_rms_norm", f"{one_gemm_ms * 1e3:.1f}",
                     "1.00", "0"]]
            variants = {}
            for config in configs:
                def split_k(i, x=x, residual=residual, norm_weight=norm_weight, weights=weights, gated=gated,
                            config=config):
                    return split_k_add_rms_norm(x, weights[i], residual, norm_weight, eps, config, gated)
                variants[str(config)] = split_k
            for splits in (s for s in cublas_splits if spans_fit(depth, s)):
                def cublas(i, x=x, residual=residual, norm_weight=norm_weight, weights=weights, gated=gated,
                           splits=splits):
                    partials = split_linear(silu_mul(x) if gated else x, weights[i], splits)
                    return add_rms_norm(residual, partials, norm_weight, eps)
                variants[f"cublas-partials-{splits}"] = cublas
            for config, split_k in variants.items():
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(split_k(0), want))
                ms = graph_ms(split_k, args.copies, args.calls, args.replays)
                rows.append([config, f"{ms * 1e3:.1f}", f"{one_gemm_ms / ms:.2f}", f"{diff:.3g}"])
                append_result(args.out, {**record, "rows": m, "gemm": gemm, "config": config,
                                         "us": round(ms * 1e3, 2), "one_gemm_us": round(one_gemm_ms * 1e3, 2),
                                         "max_diff": diff})
            table += [[m, gemm, *r] for r in rows]
    print(f"{torch.cuda.get_device_name()}: (block m, n, k, splits, warps, stages); x one GEMM = its time / this one")
    print_table(["rows", "GEMM", "kernel", "µs", "x one GEMM", "max |diff|"], table)


if __name__ == "__main__":
    main()
