"""`rope_store` alone: RoPE of q and k and the K/V cache write of a prefill forward or a decode step.

Qwen2.5-1.5B's heads (12 query, 2 KV, head_dim 128) in bf16, each shape `rows x tokens` timed as CUDA-graph
replays over --copies caches. "TB/s" counts q, k and v read once from the projection and written once (q to its
buffer, k and v to the cache). CUDA only.

    python benchmarks/rope_store_bench.py --shapes 64x128,8x1024,256x1
"""

from __future__ import annotations

import argparse

import torch
from _common import add_graph_timing_args, append_result, kernel_record, print_table
from decode_attention_bench import graph_ms

from caspo.rollout.native.rope_store import rope_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="64x128,8x1024,256x1", help="rows x tokens a row, comma-separated")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    add_graph_timing_args(parser)
    args = parser.parse_args()
    record = kernel_record("rope_store", args.commit)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    table = []
    for shape in args.shapes.split(","):
        rows, tokens = (int(n) for n in shape.split("x"))
        length = max(tokens, 1024)
        qkv = torch.randn(rows, tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
        angles = torch.arange(length, device="cuda")[:, None].float() * torch.rand(head_dim // 2, device="cuda")
        cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
        slots = torch.randperm(rows, device="cuda")
        positions = (torch.randint(0, length - tokens + 1, (rows, 1), device="cuda")
                     + torch.arange(tokens, device="cuda")).contiguous()
        caches = [torch.zeros(2, rows, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
                  for _ in range(args.copies)]
        us = 1e3 * graph_ms(lambda i: rope_store(qkv, cos, sin, positions, slots, caches[i][0], caches[i][1],  # noqa: B023
                                                 heads), args.copies, args.calls, args.replays)
        moved = 2 * qkv.numel() * qkv.element_size()
        table.append([f"{rows} x {tokens}", f"{us:.1f}", f"{moved / us / 1e6:.2f}"])
        append_result(args.out, {**record, "rows": rows, "tokens": tokens, "us": round(us, 2)})
    print(f"{torch.cuda.get_device_name()}; rope_store at {heads} / {kv_heads} heads of {head_dim}, bf16")
    print_table(["rows x tokens", "µs a call", "TB/s"], table)


if __name__ == "__main__":
    main()
