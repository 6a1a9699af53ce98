"""The decode step's GEMMs alone, at the rows of a rollout or a Monte Carlo step: how close to the card's GEMM rate.

A decode step of M rows runs, per layer, the fused q/k/v projection, the output projection, the fused
gate/up projection and the down projection, then the LM head once (Qwen2.5-1.5B by default). Each shape is
timed as CUDA-graph replays of `F.linear` cycling over --copies weight copies (so weights come from HBM, as in
a step), and reported in µs a call and TFLOP/s, beside its compute bound (--peak) and the time to read its
weight (--bandwidth). The last line sums one step: 28 layers of the four projections and the head.
With --autotune each shape is also compiled by inductor in max-autotune mode (Triton GEMM templates searched
against cuBLAS), which says whether a better kernel exists for these skinny shapes. With --partials S each shape
is also timed as the float32 partials over S spans of K that the engine's down projection uses at decode rows
(`linears.split_linear`; the partials' sum, which the next kernel does, is not timed). CUDA only.

    python benchmarks/decode_gemm_bench.py --rows 256,960 --out benchmarks/results.jsonl --commit $COMMIT
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from _common import (
    DATASHEET_TFLOPS,
    GEMM_TFLOPS,
    add_graph_timing_args,
    append_result,
    kernel_record,
    print_table,
)
from decode_attention_bench import graph_ms

from caspo.rollout.native.linears import spans_fit, split_linear


def shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict[str, tuple[int, int, int]]:
    """name -> (in features, out features, calls a step)."""
    head_dim = hidden // heads
    return {"qkv": (hidden, hidden + 2 * kv_heads * head_dim, 1), "o": (hidden, hidden, 1),
            "gate_up": (hidden, 2 * intermediate, 1), "down": (intermediate, hidden, 1), "lm_head": (hidden, vocab, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,960", help="rows of a decode step, comma-separated")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--layers", type=int, default=28)
    add_graph_timing_args(parser)
    parser.add_argument("--autotune", action="store_true", help="also time inductor's max-autotune GEMM")
    parser.add_argument("--partials", default="", help="spans of K, comma-separated: also time split_linear")
    parser.add_argument("--peak", type=float, default=GEMM_TFLOPS * 1e12,
                        help="the dense bf16 GEMM rate of the compute-bound column, FLOP/s (default: the rate measured "
                             "on H100/H200; their datasheet peak is 989e12)")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="the card's memory bandwidth, bytes/s")
    args = parser.parse_args()
    record = kernel_record("decode_gemm", args.commit)
    torch.manual_seed(0)
    variants = {"cuBLAS": F.linear}
    if args.autotune:
        variants["max-autotune"] = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    spans = {}  # partials variant -> its spans of K
    for splits in (int(s) for s in args.partials.split(",") if s):
        variants[f"partials-{splits}"] = lambda x, w, splits=splits: split_linear(x, w, splits)
        spans[f"partials-{splits}"] = splits
    table = []
    for m in (int(r) for r in args.rows.split(",")):
        step = {name: 0.0 for name in variants}
        for name, (k, n, per_layer) in shapes(args.hidden, args.intermediate, args.heads, args.kv_heads,
                                              args.vocab).items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(args.copies)]
            flops, weight_bytes = 2 * m * n * k, n * k * 2
            calls = args.layers if per_layer else 1
            for variant, linear in variants.items():
                if variant in spans and not spans_fit(k, spans[variant]):  # as the engine would not take them
                    step[variant] = float("nan")  # a step without this GEMM is no step's sum
                    continue
                ms = graph_ms(lambda i: linear(x, weights[i]), args.copies, args.calls, args.replays)  # noqa: B023
                step[variant] += ms * calls
                table.append([m, name, f"{k} -> {n}", variant, f"{ms * 1e3:.1f}", f"{flops / ms / 1e9:.0f}",
                              f"{flops / args.peak * 1e6:.1f}", f"{weight_bytes / args.bandwidth * 1e6:.1f}"])
                append_result(args.out, {**record, "rows": m, "gemm": name, "in": k, "out": n, "variant": variant,
                                         "us": round(ms * 1e3, 2), "tflops": round(flops / ms / 1e9, 1)})
        for variant, ms in step.items():
            table.append([m, "one step", f"{args.layers} layers + head", variant,
                          "–" if math.isnan(ms) else f"{ms * 1e3:.0f}", "", "", ""])
    print(f"{torch.cuda.get_device_name()}; compute bound at {args.peak / 1e12:.0f} TFLOP/s of bf16 GEMM (--peak; the "
          f"datasheet's H100/H200 peak is {DATASHEET_TFLOPS:g}), {args.bandwidth / 1e12:.1f} TB/s")
    print_table(["rows", "GEMM", "in -> out", "kernel", "µs", "TFLOP/s", "compute bound µs", "weight read µs"], table)


if __name__ == "__main__":
    main()
