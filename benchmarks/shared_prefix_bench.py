"""Shared-prefix decode attention against the split-K kernel, per layer call, at a Monte Carlo step's shape.

The Qwen2.5-1.5B decode shape (12 query heads, 2 KV heads, head_dim 128, bf16): --rows rows, each --share
of them holding one copy of a prefix of --prefix keys (VinePPO's K continuations of one prefix), each row
--suffix keys of its own after it; --rows, --prefix and --suffix take comma-separated lists, and every
combination is timed. Rows sharing a prefix are grouped by at most --members (the kernel's
query tile holds members × G query vectors). The group buffers have the engine's capacity (rows // 2
entries, the unused ones past the count). Each call is timed as a CUDA-graph replay cycling over
--layers cache layers, so K/V come from HBM rather than L2; "bound" is the time to read the K/V bytes
each variant must read once at --bandwidth. Variants: the split kernel alone (`decode_attention`), then
shared-prefix attention for each combination of --warps, --block-n and --chunks (keys per prefix program;
"auto" is split_plan's choice). Prints a table and appends one JSON line per variant to --out. CUDA only.

    python benchmarks/shared_prefix_bench.py --out benchmarks/results.jsonl --commit $COMMIT
    python benchmarks/shared_prefix_bench.py --warps 4,8 --block-n 32,64 --chunks auto,64,128 --members 5,10
    python benchmarks/shared_prefix_bench.py --rows 256 --share 8 --prefix 64,256,1024 --suffix 64,512 --key-len 0
"""

from __future__ import annotations

import argparse
import itertools
from datetime import datetime, timezone

import numpy as np
import torch
import triton
from _common import DTYPES, append_result, print_table
from decode_attention_bench import graph_ms

import caspo.rollout.native.shared_prefix_attention as spa
from caspo.rollout.native.decode_attention import decode_attention
from caspo.rollout.native.prefix_groups import PrefixGroups, group_rows


def engine_groups(rows: int, share: int, members: int, prefix: int, device: torch.device) -> PrefixGroups:
    """Rows 0.. sharing a prefix `share` at a time (row b in slot b), grouped by at most `members`, in buffers of
    the engine's capacity."""
    table, starts = group_rows(np.arange(rows) // share, np.full(rows, prefix), members)
    capacity, used = max(1, rows // 2), len(table)
    members_host = np.full((capacity, members), -1)
    group_slots, lengths = np.zeros(capacity, dtype=np.int64), np.zeros(capacity, dtype=np.int64)
    members_host[:used], group_slots[:used], lengths[:used] = table, table[:, 0], starts[table[:, 0]]
    return PrefixGroups(*(torch.from_numpy(a).to(device) for a in (members_host, group_slots, lengths, starts,
                                                                   np.array([used]))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--rows", default="960", help="rows of the step, comma-separated")
    parser.add_argument("--share", type=int, default=9, help="rows holding one prefix (K)")
    parser.add_argument("--members", default="10", help="the most rows a group holds, comma-separated")
    parser.add_argument("--prefix", default="300", help="keys of each group's shared prefix, comma-separated")
    parser.add_argument("--suffix", default="300", help="keys of each row's own after the prefix, comma-separated")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--key-len", type=int, default=1024,
                        help="the graph's key bucket (bounds every length); 0: prefix + suffix, rounded up to 64")
    parser.add_argument("--warps", default=str(spa.PREFIX_WARPS), help="prefix programs' warps, comma-separated")
    parser.add_argument("--block-n", default=str(spa.PREFIX_BLOCK_N), help="keys a loop step, comma-separated")
    parser.add_argument("--chunks", default="auto", help="keys per prefix program: auto or numbers, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="cache layers cycled through, to defeat L2")
    parser.add_argument("--calls", type=int, default=28, help="calls captured in one CUDA graph")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="the card's memory bandwidth, bytes/s")
    parser.add_argument("--commit", default="", help="the code's commit, recorded with the figures")
    parser.add_argument("--out", default="", help="append one JSON line per variant to this file")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda":
        raise SystemExit("this benchmark times CUDA kernels; run it on a CUDA device")
    rows = []
    for B, prefix, suffix in itertools.product(*(map(int, text.split(",")) for text in (args.rows, args.prefix,
                                                                                      args.suffix))):
        key_len = args.key_len or 64 * -(-(prefix + suffix) // 64)
        if prefix + suffix > key_len:
            parser.error(f"--prefix + --suffix ({prefix + suffix}) must fit --key-len ({key_len})")
        rows += measure_shape(args, B, prefix, suffix, key_len)
        torch.cuda.empty_cache()  # the last shape's caches
    print(f"{args.share} rows a prefix, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}; "
          f"{torch.cuda.get_device_name(args.device)}, triton {triton.__version__}; "
          f"bound at {args.bandwidth / 1e12:.1f} TB/s; 'saved': the share of the split kernel's keys not read")
    print_table(["rows", "prefix", "suffix", "variant", "µs a call", "bound µs", "of bound", "saved",
                 "max|Δ| vs split"], rows)


def measure_shape(args, B: int, prefix: int, suffix: int, L: int) -> list[list]:
    """The table rows of one step shape: the split kernel, then each shared-prefix variant."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    torch.manual_seed(0)
    kv = torch.randn(args.layers, 2, B, Hkv, L, D, device=device, dtype=dtype)
    q = torch.randn(B, H, D, device=device, dtype=dtype)
    lengths = torch.full((B,), prefix + suffix, device=device, dtype=torch.int64)
    slots = torch.arange(B, device=device)
    record = {"benchmark": "shared_prefix_attention", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "card": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "dtype": args.dtype,
              "shape": {"rows": B, "heads": H, "kv_heads": Hkv, "head_dim": D, "prefix": prefix,
                        "suffix": suffix, "key_len": L, "share": args.share}}
    bytes_per_key = Hkv * D * dtype.itemsize * 2  # K and V
    all_keys = B * (prefix + suffix)

    def split(layer: int) -> torch.Tensor:
        return decode_attention(q, kv[layer, 0], kv[layer, 1], lengths, L, slots)

    rows = []

    def measure(name: str, call, read_keys: int, extra: dict) -> None:
        diff = (call(0).float() - split(0).float()).abs().max().item()
        ms = graph_ms(call, args.layers, args.calls, args.replays)
        bound = read_keys * bytes_per_key / args.bandwidth * 1e3
        rows.append([B, prefix, suffix, name, f"{ms * 1e3:.1f}", f"{bound * 1e3:.1f}", f"{bound / ms:.0%}",
                     f"{1 - read_keys / all_keys:.0%}", f"{diff:.1e}"])
        append_result(args.out, {**record, "variant": name, **extra, "us": round(ms * 1e3, 2),
                                 "bound_us": round(bound * 1e3, 2), "read_keys": read_keys, "all_keys": all_keys,
                                 "max_abs_diff": diff})

    measure("split kernel", split, all_keys, {})
    for members in (int(m) for m in args.members.split(",")):
        groups = engine_groups(B, args.share, members, prefix, device)
        first = torch.arange(B, device=device) // args.share * args.share
        kv[..., :prefix, :] = kv[:, :, first, :, :prefix]  # a group's slots hold one copy of its prefix
        starts = groups.starts.cpu()
        read_keys = int(groups.count) * prefix + B * suffix + int((starts == 0).sum()) * prefix
        for warps, block_n, chunk in itertools.product(args.warps.split(","), args.block_n.split(","),
                                                       args.chunks.split(",")):
            spa.PREFIX_WARPS, spa.PREFIX_BLOCK_N = int(warps), int(block_n)
            prefix_chunk = None if chunk == "auto" else int(chunk)

            def shared(layer: int) -> torch.Tensor:
                return spa.shared_prefix_decode_attention(q, kv[layer, 0], kv[layer, 1], lengths, L, slots, groups,
                                                          prefix_chunk=prefix_chunk)

            measure(f"shared prefix: <= {members} a group, {warps} warps, {block_n} keys a step, chunk {chunk}",
                    shared, read_keys,
                    {"members": members, "warps": int(warps), "block_n": int(block_n), "chunk": chunk})
    return rows


if __name__ == "__main__":
    main()
