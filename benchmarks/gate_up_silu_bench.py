"""A decode step's gate/up projection with SiLU·up in the GEMM's epilogue, against cuBLAS and the compiled
`silu_mul`.

The engine runs the MLP's first half as two kernels: one cuBLAS GEMM over the fused [gate; up] weight, writing
[rows, 2 · intermediate] in bf16, then `runner.silu_mul`, which reads that back and writes [rows, intermediate].
At 256 rows on an H200 the pair is about 22 + 4 µs a layer. The Triton GEMM here keeps a gate and an up
accumulator for the same columns in one program, so SiLU·up is applied to them before anything is written:
half the output bytes, and no second kernel. It pays only if Triton's GEMM is within a few µs of cuBLAS's.

Rounded as the engine rounds: each accumulator to bf16 (a GEMM's output), SiLU in float32 rounded to bf16,
the product rounded to bf16. What differs from the two-kernel path is the GEMM's summation order alone.

Variants, each timed as CUDA-graph replays over --copies weight copies (weights from HBM, as in a step):
`cublas + silu_mul`, `cublas alone` (the GEMM without the second kernel, for reference), and the Triton
kernel with each configuration of CONFIGS (or --configs), through pointer loads (`ptr`) or tensor descriptors
(`tma`). Last, the `linears.GATE_UP_CONFIGS` these figures give: at each size the best setting where it beat
cuBLAS + `silu_mul` by --min-gain, None elsewhere.

    python benchmarks/gate_up_silu_bench.py --rows 64,256,960
    python benchmarks/gate_up_silu_bench.py --rows graphs --variants tma \
        --configs "64,64,64,4,3;64,64,64,4,4;64,128,64,4,4;64,32,64,4,4;128,64,64,4,3"   # every decode graph size
"""

from __future__ import annotations

import argparse
from ast import literal_eval

import torch
import torch.nn.functional as F

from caspo.rollout.native.gate_up_silu import gate_up_silu

# (rows a tile, columns a tile of each of gate and up, K a loop step, warps, pipeline stages), each timed with
# pointer loads and with tensor descriptors
CONFIGS = [(128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
           (64, 128, 64, 8, 3), (64, 64, 64, 4, 3), (64, 64, 64, 4, 5), (64, 64, 128, 4, 3), (64, 32, 64, 4, 4),
           (64, 32, 128, 4, 4), (128, 32, 64, 4, 4), (128, 32, 128, 4, 4), (128, 64, 128, 8, 3),
           (256, 64, 64, 8, 3)]


def gate_up_table(best: list[tuple[int, float, tuple | None, float]], min_gain: float) -> tuple:
    """`linears.GATE_UP_CONFIGS` from (rows, µs of cuBLAS + silu_mul, best launch, its µs) per size, rows rising:
    the launch where it is at least `min_gain` × faster, None elsewhere; neighbours with the same choice share one
    entry, and the trailing None entries go (past the last entry the engine keeps cuBLAS + silu_mul)."""
    table: list[tuple[int, tuple | None]] = []
    for rows, base_us, config, us in best:
        choice = config if config is not None and base_us >= min_gain * us else None
        if table and table[-1][1] == choice:
            table[-1] = (rows, choice)
        else:
            table.append((rows, choice))
    while table and table[-1][1] is None:
        table.pop()
    return tuple(table)


def parse_rows(text: str) -> list[int]:
    """--rows: comma-separated counts, or `graphs` for every decode graph size up to 1,024 rows."""
    from caspo.rollout.native.graphs import default_batch_sizes

    return default_batch_sizes(1024) if text == "graphs" else [int(r) for r in text.split(",")]


def main() -> None:
    from _common import add_graph_timing_args, append_result, kernel_record, print_table
    from decode_attention_bench import graph_ms

    from caspo.rollout.native.runner import silu_mul

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,256,960",
                        help="rows of a decode step, comma-separated, or `graphs`: every decode graph size")
    parser.add_argument("--configs", default="", help="tile settings in place of CONFIGS, `;`-separated")
    parser.add_argument("--min-gain", type=float, default=1.03, help="the speed-up a size's table entry needs")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--variants", default="ptr,tma", help="the Triton kernel's loads: ptr, tma or both")
    add_graph_timing_args(parser)
    args = parser.parse_args()
    record = kernel_record("gate_up_silu", args.commit)
    torch.manual_seed(0)
    k, inter = args.hidden, args.intermediate
    weights = [torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(args.copies)]
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")] if args.configs else CONFIGS
    table, best = [], {}
    for m in parse_rows(args.rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = silu_mul(F.linear(x, weights[0]))
        flops = 2 * m * k * 2 * inter
        calls = {"cublas + silu_mul": lambda i, x=x: silu_mul(F.linear(x, weights[i])),
                 "cublas alone": lambda i, x=x: F.linear(x, weights[i])}
        for tma in (v == "tma" for v in args.variants.split(",")):
            for config in configs:
                calls[f"{'tma' if tma else 'ptr'} {config}"] = (
                    lambda i, x=x, config=(*config, tma): gate_up_silu(x, weights[i], config))
        base_ms = None
        for name, call in calls.items():
            try:
                got = call(0)
                ms = graph_ms(call, args.copies, args.calls, args.replays)
            except Exception as error:  # a configuration the card cannot hold (shared memory, registers)
                table.append([m, name, "failed", "", "", str(error).splitlines()[0][:60], ""])
                continue
            base_ms = base_ms or ms
            same = "" if name == "cublas alone" else f"{(got != want).float().mean().item():.4f}"
            diff = "" if name == "cublas alone" else f"{(got.float() - want.float()).abs().max().item():.3g}"
            table.append([m, name, f"{ms * 1e3:.1f}", f"{flops / ms / 1e9:.0f}", f"{base_ms / ms:.2f}", diff, same])
            loads = name.split(" ")[0]
            if loads in ("ptr", "tma") and ms < best.get((m, loads), ("", 1e9))[1]:
                best[(m, loads)] = (name[len(loads) + 1:], ms, base_ms)
            append_result(args.out, {**record, "rows": m, "variant": name, "us": round(ms * 1e3, 2)})
    print(f"{torch.cuda.get_device_name()}: gate/up {k} -> 2 x {inter} and SiLU·up; "
          "(block m, block n of each half, block k, warps, stages)")
    print_table(["rows", "variant", "µs", "TFLOP/s", "x cublas + silu_mul", "max |diff|", "share unequal"], table)
    for (m, loads), (config, ms, base_ms) in best.items():  # one line each, for scripts to read
        print(f"best {loads} {m} {config.replace(' ', '')} {ms * 1e3:.2f} us against {base_ms * 1e3:.2f}")
    sizes = []  # each size's best over both loads, as the table's launches
    for m in sorted({m for m, _ in best}):
        loads, (config, ms, base_ms) = min(((l, v) for (n, l), v in best.items() if n == m), key=lambda b: b[1][1])
        sizes.append((m, base_ms * 1e3, (*literal_eval(config), loads == "tma"), ms * 1e3))
    print(f"GATE_UP_CONFIGS = {gate_up_table(sizes, args.min_gain)}  # a gain of {args.min_gain} x or more")


if __name__ == "__main__":
    main()
