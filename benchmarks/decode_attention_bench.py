"""Decode attention: the split-K Triton kernel against the engine's SDPA path, per layer call; and where the
engine fuses them (one split), RoPE + the K/V write + attention in one kernel against rope_store then the
split-K kernel.

The Qwen2.5-1.5B decode shape (256 rows, 12 query heads, 2 KV heads, head_dim 128, bf16) over a
cache of 640 positions, every row at key_len keys. SDPA is runner.grouped_attention with the
folded-GQA boolean mask, as the engine decodes today. Each call is timed as a CUDA-graph replay
(the engine replays graphs; a Triton launch from Python costs more than the kernel) cycling over
--layers cache layers, so K/V come from HBM rather than L2. Effective bandwidth counts K and V
read once: B·Hkv·key_len·D·2 bytes·2. The max |difference| against SDPA is printed at each shape (for the
RoPE pair, SDPA over the rotated query and the cache holding the new key). --block-n, --num-warps and
--num-stages set the split-K and the fused kernels' blocks, warps and stages. Prints a table and appends
one JSON line per measurement to --out. CUDA only.

    python benchmarks/decode_attention_bench.py --out benchmarks/results.jsonl --commit $COMMIT
    python benchmarks/decode_attention_bench.py --splits 1,2,4 --num-stages 3   # tuning
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

import torch
import triton
from _common import DTYPES, append_result, print_table

import caspo.rollout.native.decode_attention as kernel
import caspo.rollout.native.rope_attention as fused
from caspo.rollout.native.rope_store import rope_store
from caspo.rollout.native.runner import Batch, grouped_attention


def graph_ms(call, layers: int, calls: int, replays: int) -> float:
    """ms per call(layer) captured `calls` times in one CUDA graph (layers in turn), over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm outside the capture
        for layer in range(layers):
            call(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % layers)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def eager_ms(call, layers: int, reps: int) -> float:
    """ms per call(layer) launched from Python: kernel time plus launch overhead."""
    for layer in range(layers):
        call(layer)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        call(i % layers)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cache-len", type=int, default=640, help="positions per cache slot (max_seq_len)")
    parser.add_argument("--key-lens", default="128,384,640", help="keys per row, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="cache layers cycled through, to defeat L2")
    parser.add_argument("--calls", type=int, default=64, help="calls captured in one CUDA graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--splits", default="", help="also time these forced num_splits, comma-separated")
    parser.add_argument("--block-n", type=int, default=kernel.BLOCK_N)
    parser.add_argument("--num-warps", type=int, default=kernel.NUM_WARPS)
    parser.add_argument("--num-stages", type=int, default=kernel.NUM_STAGES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="", help="the code's commit, recorded with the figures")
    parser.add_argument("--out", default="", help="append one JSON line per measurement to this file")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("this benchmark times CUDA kernels; run it on a CUDA device")
    kernel.BLOCK_N, kernel.NUM_WARPS, kernel.NUM_STAGES = args.block_n, args.num_warps, args.num_stages
    fused.BLOCK_N, fused.NUM_WARPS, fused.NUM_STAGES = args.block_n, args.num_warps, args.num_stages

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    B, H, Hkv, D, L = args.batch, args.heads, args.kv_heads, args.head_dim, args.cache_len
    torch.manual_seed(args.seed)
    # The engine's layout: [planes, layers, 2, slots, kv_heads, max_seq_len, head_dim]; k/v are views.
    kv = torch.randn(1, args.layers, 2, B, Hkv, L, D, device=device, dtype=dtype)
    q = torch.randn(B, 1, H, D, device=device, dtype=dtype)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=device, dtype=dtype)
    angles = torch.arange(L, device=device)[:, None] * 10000.0 ** (-torch.arange(0, D, 2, device=device) / D)
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.arange(B, device=device)
    record = {"benchmark": "decode_attention", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "card": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": triton.__version__, "commit": args.commit, "dtype": args.dtype,
              "shape": {"batch": B, "heads": H, "kv_heads": Hkv, "head_dim": D, "cache_len": L},
              "block_n": args.block_n, "num_warps": args.num_warps, "num_stages": args.num_stages}

    rows = []
    for key_len in (int(k) for k in args.key_lens.split(",")):
        lengths = torch.full((B,), key_len, device=device, dtype=torch.int32)
        batch = Batch.build(torch.arange(B, device=device), (lengths - 1)[:, None].long(), key_len, H // Hkv,
                            rows_are_slots=True)

        def sdpa(layer: int) -> torch.Tensor:
            return grouped_attention(q, batch.read(kv[0, layer, 0]), batch.read(kv[0, layer, 1]), batch.mask)

        want = sdpa(0).view(B, H, D).float()
        kv_bytes = B * Hkv * key_len * D * dtype.itemsize * 2
        auto = kernel.split_plan(B, Hkv, key_len)[0]
        forced = [int(s) for s in args.splits.split(",") if s and int(s) != auto]
        variants = [("sdpa", None, sdpa)] + [
            ("split-k", splits, lambda layer, splits=splits: kernel.decode_attention(
                q[:, 0], kv[0, layer, 0], kv[0, layer, 1], lengths, key_len,
                num_splits=None if splits == auto else splits))
            for splits in [auto] + forced]
        def measure(name, splits, call, reference):
            diff = (call(0).view(B, H, D).float() - reference).abs()
            ms = graph_ms(call, args.layers, args.calls, args.replays)
            ms_eager = eager_ms(call, args.layers, args.calls * args.replays // 4)
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            rows.append([key_len, name, splits or "-", f"{ms:.4f}", f"{ms_eager:.4f}", f"{gbps:,.0f}",
                         f"{diff.max().item():.2e}", f"{diff.mean().item():.2e}"])
            append_result(args.out, {**record, "key_len": key_len, "impl": name, "num_splits": splits,
                                     "auto_splits": splits == auto if splits else None, "ms": round(ms, 5),
                                     "ms_eager": round(ms_eager, 5), "kv_gb_per_s": round(gbps, 1),
                                     "max_abs_diff_vs_sdpa": diff.max().item(),
                                     "mean_abs_diff_vs_sdpa": diff.mean().item()})

        for name, splits, call in variants:
            measure(name, splits, call, want)
        if fused.fuses(dtype, B, Hkv, key_len):  # the engine's decode step: RoPE and the K/V write, then attention
            positions = (lengths - 1).long()

            def two_kernels(layer: int) -> torch.Tensor:
                k, v = kv[0, layer, 0], kv[0, layer, 1]
                rotated = rope_store(qkv[:, None], cos, sin, positions[:, None], slots, k, v, H)
                return kernel.decode_attention(rotated[:, 0], k, v, lengths, key_len, slots)

            def one_kernel(layer: int) -> torch.Tensor:
                return fused.rope_decode_attention(qkv, cos, sin, positions, lengths, slots, key_len,
                                                   kv[0, layer, 0], kv[0, layer, 1], H)

            # (these write the new key into the cache, so they come after the others)
            k, v = kv[0, 0, 0], kv[0, 0, 1]
            rotated = rope_store(qkv[:, None], cos, sin, positions[:, None], slots, k, v, H)
            rotated_want = grouped_attention(rotated, batch.read(k), batch.read(v), batch.mask).view(B, H, D).float()
            measure("rope_store+split-k", 1, two_kernels, rotated_want)
            measure("rope+attention fused", 1, one_kernel, rotated_want)

    print(f"decode attention: B={B}, H={H}, Hkv={Hkv}, D={D}, cache {L} positions, {args.dtype}, "
          f"{args.layers} layers cycled; {torch.cuda.get_device_name(device)}, triton {triton.__version__}; "
          f"BLOCK_N={args.block_n}, num_warps={args.num_warps}, num_stages={args.num_stages}")
    print_table(["keys", "impl", "splits", "ms (graph)", "ms (eager)", "K/V GB/s", "max|Δ| vs sdpa",
                 "mean|Δ|"], rows)


if __name__ == "__main__":
    main()
