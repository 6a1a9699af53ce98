"""`caspo value collect --nproc N`: the shards of one collection as N processes at once, one per device, then
merged. Each process runs the same command with `--shard r/N` (prompts r, r + N, ...) and its own output file;
the merged file is the unsharded collection's (caspo.value.labels.merge_label_files), and the shards are removed
once it is written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from caspo.config import ConfigError
from caspo.value.labels import merge_label_files


def shard_path(out: Path, rank: int, n: int) -> Path:
    return out.with_name(f"{out.stem}.shard{rank}of{n}{out.suffix}")


def merge_shards(out: Path, n: int, allow_empty: bool = True) -> int:
    """Merge the n shards of `out` into it, then remove them (the merged file holds all their rows); returns
    the number of rows. Without `allow_empty`, shards without a row are a LabelFileError (and stay)."""
    paths = [shard_path(out, r, n) for r in range(n)]
    rows = len(merge_label_files(paths, out, allow_empty).rows)
    for path in paths:
        path.unlink()
    return rows


def shard_env(rank: int, devices: Sequence[str] | None) -> dict:
    """Shard r's environment: on CUDA the r-th device alone (so model.device=cuda is that device)."""
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices[rank]
    return env


def cuda_devices(nproc: int) -> list[str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < nproc:
        raise ConfigError(f"--nproc {nproc} on CUDA needs {nproc} devices, this host shows {len(devices)}")
    return devices[:nproc]


def collect_shards(argv: Sequence[str], out: Path, nproc: int, on_cuda: bool) -> int:
    """Run `caspo value collect <argv> --shard r/N --out <shard r>` for every r at once and merge the shards
    into `out` (`merge_shards`). A failed shard stops the others; the shards that finished stay for a rerun to
    inspect."""
    devices = cuda_devices(nproc) if on_cuda else None
    paths = [shard_path(out, r, nproc) for r in range(nproc)]
    children = [subprocess.Popen([sys.executable, "-m", "caspo.cli", "value", "collect", *argv, "--shard",
                                  f"{r}/{nproc}", "--out", str(paths[r])], env=shard_env(r, devices))
                for r in range(nproc)]
    while True:  # until every shard ended, or one failed: the others then stop now, not when they end
        codes = [child.poll() for child in children]
        failed = next((r for r, code in enumerate(codes) if code), None)
        if failed is not None or None not in codes:
            break
        time.sleep(0.2)
    if failed is not None:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            child.wait()
        raise ConfigError(f"shard {failed}/{nproc} of the collection failed (its error is above); the others "
                          "were stopped")
    return merge_shards(out, nproc, allow_empty=False)  # a collection without a row is no use
