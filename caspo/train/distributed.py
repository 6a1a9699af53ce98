"""Data parallelism: one process per device, each with its own engine, joined by torch.distributed.

`caspo train PRESET --nproc N` starts N processes with torchrun (`launch_command`); so does
`torchrun --nproc-per-node N -m caspo.cli train PRESET` on one host or several. A process
started that way calls `start(cfg)` first: it joins the process group (gloo on the CPU, nccl
on CUDA with device = local rank). A run of one process never creates a group: `active()`
is False and every helper here is then the identity, so that path is the single-process one.

What each rank does in an outer step (`caspo.train.loop.outer_step`):

    rollout      the step's prompts in contiguous blocks, one per rank (a prompt's G samples stay
                 together); every sample's seed is global, so no sample depends on N; the
                 completions are gathered, and every rank holds the whole batch
    rewards      each rank scores its block's rows; gathered
    old / ref    each rank scores its rows; gathered
    advantages   the whole batch on every rank: the same inputs, the same numbers
    update       each minibatch (the same rows whatever N is) in N contiguous blocks; the loss is
                 normalised by the whole minibatch's counts and FSDP sums the gradients
    publication  every parameter gathered in full, one at a time, into the rank's engine

Rank 0 writes the run's files and prints; the others write their checkpoint shards and their own
metrics in `ranks/rank<r>/` (`log_dir`). Decisions that end or save a run are rank 0's (`from_main`,
`any_rank`), so that every rank takes the same collectives.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from caspo.config import Config, ConfigError
from caspo.runlog import console

# what deterministic cuBLAS and NCCL reductions need in the environment, before the group's communicator exists
# (a launcher passes it to every rank)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}

# ---------------------------------------------------------------- the process group


def launched() -> bool:
    """This process was started by torchrun (or another launcher setting WORLD_SIZE) with several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def check_config(cfg: Config, nproc: int) -> None:
    """A ConfigError for a setting that `nproc` processes cannot honour."""
    if nproc > 1 and cfg.model.device.startswith("cuda:"):
        raise ConfigError(f"model.device={cfg.model.device} with {nproc} processes: each rank takes the device of "
                          "its local rank; use model.device=cuda (or auto)")


def start(cfg: Config) -> Config:
    """Join the process group when this process is one of several ranks: on CUDA the current device becomes
    cuda:LOCAL_RANK (where model.device=cuda then points). Returns the rank's config: rank 0's is `cfg`, the
    others' report to no tracker. In a single process: `cfg` as it is, and no group."""
    if not launched():
        return cfg
    check_config(cfg, int(os.environ["WORLD_SIZE"]))
    if cfg.train.deterministic:  # ranks started by another launcher than `caspo train --nproc` need it too
        os.environ.update(DETERMINISTIC_ENV)
    join(cfg.model.device, cfg.train.collective_timeout_minutes)
    if not is_main():  # rank 0 prints and reports to the trackers; the others keep their own metrics.jsonl
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loggers=["jsonl"]))
    return cfg


def join(device: str, timeout_minutes: int = 30) -> None:
    """Join the launcher's process group (gloo on the CPU; nccl on CUDA, the current device cuda:LOCAL_RANK
    for `device` cuda, or auto with a GPU); ranks other than 0 print nothing."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        if torch.cuda.device_count() <= local:
            raise ConfigError(f"rank {os.environ.get('RANK')} has local rank {local}, but this host shows "
                              f"{torch.cuda.device_count()} CUDA devices; start at most that many processes per host")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        # one timeout for both backends (NCCL's default is 10 minutes): rank 0 alone writes exports and logs
        dist.init_process_group("nccl" if on_cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes),
                                device_id=torch.device("cuda", local) if on_cuda else None)
        atexit.register(stop)
    if not is_main():
        console.quiet = True


def log_dir(run_dir: Path) -> Path:
    """Where this rank writes its run files: the run folder on rank 0, `ranks/rank<r>/` in it on the others
    (their metrics beside rank 0's, with their own timings). Checkpoints are the run folder's, written by all."""
    return run_dir if is_main() else run_dir / "ranks" / f"rank{rank()}"


def stop() -> None:
    """Leave the process group, if this process joined one (at exit, whatever the way out)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish() -> None:
    """The end of a rank's work, once its models are out of reach: collect them (FSDP's modules sit in
    reference cycles, and hold the group's pending work objects), wait for every rank, and leave the group
    while the interpreter is whole. Left to the interpreter's exit, those objects were freed during its
    finalization and aborted about one gloo rank in fifteen on a loaded CPU ("terminate called without an active
    exception", after the rank's work was done)."""
    gc.collect()
    if active():
        dist.barrier()
    stop()


def launch_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """The torchrun command that runs `caspo <argv>` as `nproc` ranks on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "caspo.cli", *argv]


def launch_env(shutdown_s: int) -> dict[str, str]:
    """torchrun's environment: it passes a stop signal on to the ranks and SIGKILLs them `shutdown_s` later
    (its default, 30 s, is shorter than a step and its checkpoint; a torch release that reads no such
    variable keeps 30 s)."""
    return {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_s)}


# ---------------------------------------------------------------- collectives (identity in one process)


def barrier() -> None:
    if active():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (picklable Python objects)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def from_main(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn, *args):
    """`fn(*args)` run by rank 0 alone (e.g. preparing the run folder), its result on every rank; an error
    it raises is raised on every rank."""
    if not active():
        return fn(*args)
    result = error = None
    if is_main():
        try:
            result = fn(*args)
        except Exception as err:  # raised again below, on every rank
            error = err
    result, error = from_main((result, error))
    if error is not None:
        raise error
    return result


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any."""
    if not active():
        return flag
    t = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """The sum over ranks of each value, over the keys any rank has (a missing one counts 0)."""
    if not active():
        return values
    keys = sorted(set().union(*gather_objects(sorted(values))))
    t = torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def all_max(value: int) -> int:
    if not active():
        return value
    t = torch.tensor([value], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def collective_device() -> torch.device:
    """Where small tensors for collectives live: the rank's CUDA device under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- splitting the batch


def block(n: int, of: int | None = None, world: int | None = None) -> range:
    """Rank `of`'s contiguous block of n items (this rank's by default); the first n % world blocks hold
    one item more, as torch.tensor_split splits."""
    r, w = rank() if of is None else of, size() if world is None else world
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def gather_rows(local: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, ...] tensor whose rows `block(n, r)` rank r holds as `local`, on every rank."""
    if not active():
        return local
    width = len(block(n, 0))  # the widest block
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[:len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded)
    return torch.cat([part[:len(block(n, r))] for r, part in enumerate(parts)])


def gather_ragged(local: torch.Tensor) -> torch.Tensor:
    """Every rank's [b_r, S_r] block stacked in rank order on the CPU, each padded with zeros to the widest S_r
    (`local` itself in one process)."""
    if not active():
        return local
    parts = gather_objects(local.cpu())
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def my_rows(rows: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous block of `rows` (all of them in one process)."""
    share = block(len(rows))
    return rows[share.start:share.stop]


def share_rows(x: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """`x` [B, ...] whose rows `mine` ([B] bool) this rank filled and each other row another rank did: every
    rank's rows, on every rank, exactly (the others add zeros)."""
    if not active():
        return x
    out = torch.where(mine.view(-1, *[1] * (x.dim() - 1)).to(x.device), x, torch.zeros_like(x))
    dist.all_reduce(out)
    return out
