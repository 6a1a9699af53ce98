"""How the native runner lays out its linear layers' GEMMs on CUDA; what is computed stays each layer's own.

- `fuse_linears`: q/k/v, and gate/up, each one GEMM over a weight whose row blocks are the named parameters.
- `split_linear`: a decode step's down projection as float32 partials over spans of K, summed by the next
  norm's kernel (`settled`) where cuBLAS would split K itself and reduce in a kernel of its own.
- `gate_up_config`: the decode sizes whose gate/up projection runs as `gate_up_silu.py`'s GEMM with SiLU·up in
  its epilogue, and its launch configuration there.
"""

from __future__ import annotations

import torch
from torch import nn


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [Σ out, in] weight (and bias) whose row blocks become the linears' parameters, as views.

    The block then runs one GEMM where it ran several small ones (k/v are 8× smaller than q in
    Qwen2.5), while the parameters keep their names and storage for loading and publication:
    an in-place copy into `k_proj.weight` lands in the fused weight.
    """
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if has_bias:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


# Spans of K for the down projection of a decode step on CUDA, by rows: (at most these rows, spans). At 256 rows
# its output is 24 tiles of 128 × 128 for 132 SMs, so cuBLAS splits K itself and reduces in a kernel of its own;
# `split_linear` leaves the partials for the next norm's kernel to sum instead. Where that is faster depends on
# the kernel cuBLAS picks for each shape: on an H100 (cuBLAS of CUDA 13.0) the partials won at every graph size
# up to 256 rows (by 1.06-1.46 ×), at 384 and at 448-512, and lost at 320, 576, 640, 768, 960 and 1,024
# (split_k_bench.py, benchmarks/RESULTS.md). Past the last entry (larger decode steps, every prefill) one GEMM.
DOWN_SPLITS = ((96, 2), (256, 4), (320, 1), (384, 4), (512, 2))


def spans_fit(depth: int, splits: int) -> bool:
    """Whether K = depth cuts into `splits` equal spans of whole 16-byte (8 bf16) vectors, as `split_linear`'s
    views need for cuBLAS's aligned kernels."""
    return depth % (8 * splits) == 0


def down_splits(rows: int, depth: int) -> int:
    """How many spans of K `MLP.deferred` cuts a down projection of `rows` rows and K = depth into (1: none)."""
    for most_rows, splits in DOWN_SPLITS:
        if rows <= most_rows:
            return splits if spans_fit(depth, splits) else 1
    return 1


# A launch of `gate_up_silu`: (rows a tile, columns a tile of each of gate and up, K a loop step, warps, pipeline
# stages, tiles moved by tensor descriptors (TMA) rather than pointer loads).
GateUpConfig = tuple[int, int, int, int, int, bool]

# Decode graph sizes (`graphs.default_batch_sizes`) where `gate_up_silu` beat cuBLAS + silu_mul by 3% or more on an
# H100 (gate/up 1,536 -> 2 x 8,960), by rows: (at most these rows, its launch, or None for cuBLAS + silu_mul). It won
# by 1.03-1.15 x at 2-128 rows, where the GEMM is bound by reading the weight; at 192, 320 and 448 (1.15, 1.52 and
# 1.20 x), where cuBLAS's own pick is slow; and at 832-960 (1.08-1.11 x). It lost at 144-160 and 208-256 (at 256 its
# 560 tiles fill 132 SMs in 4.24 waves), 512 and 640-768, and tied at the rest (benchmarks/RESULTS.md, thirty-fourth
# series). On an H200 the same entries lost nowhere by more than 1.5% (thirty-fifth series). Past the last entry
# (larger decode steps and prefills), cuBLAS + silu_mul.
_WIDE, _SQUARE, _SQUARE_3_STAGES = (64, 128, 64, 4, 4, True), (64, 64, 64, 4, 4, True), (64, 64, 64, 4, 3, True)
_NARROW, _TALL = (64, 32, 64, 4, 4, True), (128, 64, 64, 4, 3, True)
GATE_UP_CONFIGS: tuple[tuple[int, GateUpConfig | None], ...] = (
    (1, None), (8, _WIDE), (32, _SQUARE), (64, _NARROW), (128, _SQUARE_3_STAGES), (176, None), (192, _SQUARE),
    (256, None), (320, _SQUARE_3_STAGES), (384, None), (448, _WIDE), (768, None), (832, _WIDE), (896, _TALL),
    (960, _WIDE))
# The compute capability (major) the table was measured on: Hopper, whose TMA the tensor-descriptor launches use.
GATE_UP_CAPABILITY = 9


def gate_up_config(rows: int, depth: int, inter: int, capability: int) -> GateUpConfig | None:
    """The launch `MLP.deferred` runs a gate/up projection of `rows` rows, K = depth and `inter` columns a half
    with on a card of this compute capability (major); None for cuBLAS + silu_mul, also where the tensor
    descriptors cannot hold the shape (rows of whole 16-byte vectors, each half in whole column tiles)."""
    if capability != GATE_UP_CAPABILITY:
        return None
    for most_rows, config in GATE_UP_CONFIGS:
        if rows <= most_rows:
            return config if config is not None and spans_fit(depth, 1) and inter % config[1] == 0 else None
    return None


def split_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x Wᵀ as float32 partials [splits, *x.shape[:-1], out] over `splits` equal spans of K, from one cuBLAS
    strided-batched GEMM on views (x [rows, K] as [S, rows, K / S], Wᵀ [K, out] as [S, K / S, out]): the
    partial sums a split-K GEMM makes, left for `settled` to add up. bf16/fp16 on CUDA only (their float32
    outputs); float32 anywhere."""
    depth, out = x.shape[-1], weight.shape[0]
    if depth % splits:
        raise ValueError(f"{splits} spans do not divide K = {depth}")
    span = depth // splits
    a = x.reshape(-1, splits, span).transpose(0, 1)
    b = weight.t().view(splits, span, out)
    partials = torch.bmm(a, b) if x.dtype == torch.float32 else torch.bmm(a, b, out_dtype=torch.float32)
    return partials.view(splits, *x.shape[:-1], out)


def settled(delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A GEMM's output in x's dtype: `delta` itself, or the sum of its float32 partials [S, *x.shape] over spans
    of K (`split_linear`), rounded once as the GEMM rounds its float32 accumulator."""
    if delta.dim() == x.dim():
        return delta
    total = delta[0]
    for partial in delta[1:]:  # element-wise adds, which inductor fuses into the norm (sum(0) is a kernel of its own)
        total = total + partial
    return total.to(x.dtype)
