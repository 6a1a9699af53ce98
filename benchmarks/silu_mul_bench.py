"""SiLU(gate) · up of a decode step, as the engine compiles it and as alternatives, against the bandwidth bound.

The engine runs `runner.silu_mul` (torch.compile with dynamic leading dimensions) on the fused gate/up
projection's output, [rows, 1, 2 · intermediate] in a decode step, after the prefill has met it first at
[prompts, tokens, 2 · intermediate]. Variants, each timed as CUDA-graph replays over --copies inputs:

    engine     runner.silu_mul, first called at a prefill shape, then at the decode shape (as in a rollout);
    fresh      the same function compiled anew, first called at the decode shape;
    static     torch.compile(dynamic=False) of the same function on the 2-D decode input;
    eager      F.silu(gate) * up.

"bound" reads the input and writes the output once at --bandwidth. With TORCH_LOGS=output_code the
generated kernels (and their launch configurations) go to stderr. CUDA only.

    python benchmarks/silu_mul_bench.py --rows 256,960
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import add_graph_timing_args, append_result, kernel_record, print_table
from decode_attention_bench import graph_ms

from caspo.rollout.native import runner


def plain(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,960")
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--prefill", default="4,2048", help="prompts,tokens of the prefill the engine meets first")
    add_graph_timing_args(parser, copies=8)
    parser.add_argument("--bandwidth", type=float, default=4.8e12)
    args = parser.parse_args()
    record = kernel_record("silu_mul", args.commit)
    width = 2 * args.intermediate
    prompts, tokens = (int(n) for n in args.prefill.split(","))
    runner.silu_mul(torch.randn(prompts, tokens, width, device="cuda", dtype=torch.bfloat16))  # the prefill first
    fresh = runner.compiled_on_cuda(plain)
    static = torch.compile(plain, dynamic=False, options={"emulate_precision_casts": True})
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, 1, width, device="cuda", dtype=torch.bfloat16) for _ in range(args.copies)]
        flat = [x.view(rows, width) for x in inputs]
        expected = plain(inputs[0])
        variants = {"engine": lambda i: runner.silu_mul(inputs[i]), "fresh": lambda i: fresh(inputs[i]),  # noqa: B023
                    "static": lambda i: static(flat[i]), "eager": lambda i: plain(inputs[i])}  # noqa: B023
        bound_us = rows * width * 1.5 * 2 / args.bandwidth * 1e6
        for name, call in variants.items():
            same = torch.equal(call(0).view(rows, -1), expected.view(rows, -1))
            ms = graph_ms(call, args.copies, args.calls, args.replays)
            table.append([rows, name, f"{ms * 1e3:.1f}", f"{bound_us:.1f}", f"{bound_us / (ms * 1e3):.0%}", same])
            append_result(args.out, {**record, "rows": rows, "variant": name, "us": round(ms * 1e3, 2),
                                     "bound_us": round(bound_us, 2), "equal": same})
    print(f"{torch.cuda.get_device_name()}; SiLU·up of [rows, {width}] bf16; bound at {args.bandwidth / 1e12:.1f} TB/s")
    print_table(["rows", "variant", "µs a call", "bound µs", "of bound", "equal to eager"], table)


if __name__ == "__main__":
    main()
