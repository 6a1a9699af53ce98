"""What each outer step leaves allocated on the GPU, by the line that allocated it.

`trainer_smoke.py --memory-growth DIR` runs the trainer with the CUDA caching allocator's history on
(Python stacks), takes a snapshot of the live blocks after every outer step, and writes per step the
bytes that stayed allocated, and each allocation site's net change against the step before: blocks
alive now that were not (or were another size), less those freed since. A run whose allocated memory
rises by the same amount every step holds something per step; the site that rises with it is where.

The diff works on the snapshot's plain dicts (`torch.cuda.memory._snapshot()`), so it is tested on
the CPU with hand-made ones.
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from pathlib import Path

SITE_FRAMES = 4  # the innermost frames of the project's own code that name a site


def live_blocks(snapshot: dict) -> dict[int, tuple[int, str]]:
    """{address: (size, site)} of every allocated block in a snapshot, in any memory pool."""
    live = {}
    for segment in snapshot["segments"]:
        pool = segment.get("segment_pool_id", (0, 0))
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = block["size"], site(block.get("frames", []), pool)
    return live


def site(frames: list[dict], pool=(0, 0)) -> str:
    """The innermost frames in the project (caspo/ or benchmarks/), innermost first, else the innermost frame
    (the backward runs on autograd's thread, under no project frame: a compiled block's backward is named by
    inductor's generated file); a CUDA graph's private pool is named, since its blocks live as long as the
    graph (or a tensor of it)."""
    own = [f for f in frames if "/caspo/" in f["filename"] or "/benchmarks/" in f["filename"]] or frames[:1]
    where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in own[:SITE_FRAMES])
    where = where or "(no stack)"
    return where + (f" [graph pool {tuple(pool)}]" if tuple(pool) != (0, 0) else "")


def net_by_site(before: dict[int, tuple[int, str]], after: dict[int, tuple[int, str]]) -> dict[str, int]:
    """Bytes each site holds more in `after` than in `before` (blocks matched by address and size)."""
    net: dict[str, int] = defaultdict(int)
    for address, (size, where) in after.items():
        if before.get(address, (None, None))[0] != size:
            net[where] += size
    for address, (size, where) in before.items():
        if after.get(address, (None, None))[0] != size:
            net[where] -= size
    return {where: n for where, n in net.items() if n}


def report(steps: list[dict[int, tuple[int, str]]], top: int = 12) -> str:
    """Each step's allocated total, then the sites whose holdings rose, summed over the changes of steps 3..
    (steps 1 and 2 allocate what every run keeps: optimizer state, compiled graphs, the first recaptured
    graphs), with the change in each step."""
    lines = ["step  allocated GiB  change GiB"]
    totals = [sum(size for size, _ in live.values()) for live in steps]
    for i, total in enumerate(totals):
        change = f"{(total - totals[i - 1]) / 2**30:+.3f}" if i else "-"
        lines.append(f"{i + 1:>4}  {total / 2**30:>13.3f}  {change:>10}")
    changes = [net_by_site(a, b) for a, b in zip(steps[1:-1], steps[2:])] if len(steps) > 2 else []
    sites = defaultdict(int)
    for change in changes:
        for where, n in change.items():
            sites[where] += n
    rising = sorted((w for w in sites if sites[w] > 0), key=lambda w: -sites[w])[:top]
    lines += ["", "sites that held more at the end of each step than at the end of the step before (MiB), "
                  f"steps 3..{len(steps)}:"]
    for where in rising:
        per_step = " ".join(f"{c.get(where, 0) / 2**20:+.1f}" for c in changes)
        lines.append(f"  {sites[where] / 2**20:+9.1f}  ({per_step})  {where}")
    if not rising:
        lines.append("  none")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def growth_tracked(out: Path):
    """Patch the trainer's outer step to snapshot the live blocks after each step; write `report` to `out`."""
    import torch

    from caspo.train import loop

    if not torch.cuda.is_available():
        raise SystemExit("--memory-growth reads the CUDA caching allocator's history: run it on a GPU")
    original, steps = loop.outer_step, []

    def outer_step(tr):
        result = original(tr)
        gc.collect()
        torch.cuda.synchronize(tr.device)
        steps.append(live_blocks(torch.cuda.memory._snapshot()))
        return result

    torch.cuda.memory._record_memory_history(max_entries=1, stacks="python")  # stacks of live blocks only
    loop.outer_step = outer_step
    try:
        yield
    finally:
        loop.outer_step = original
        torch.cuda.memory._record_memory_history(enabled=None)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report(steps))
        print(out.read_text())
