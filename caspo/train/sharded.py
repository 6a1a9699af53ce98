"""Checkpoints of a run of several processes: DCP shards, each rank's RNG, and rank 0's HF export.

The layout is `caspo.train.checkpoint`'s (`shards/`, `ranks/`); the folder is built and renamed into
place as a single process's is, and rank 0 writes the manifest once every rank has written its part.
The models and optimizer states go through `torch.distributed.checkpoint.state_dict`, so their keys
are the parameters' names whatever the sharding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from caspo.train import checkpoint as ckpt
from caspo.train import distributed
from caspo.train.optim import Learner


def sharded_state(learners: dict[str, Learner]) -> dict:
    """What DCP writes and reads: each learner's parameters and optimizer state, by parameter name."""
    return {"models": {name: get_model_state_dict(lr.model) for name, lr in learners.items()},
            "optimizers": {name: get_optimizer_state_dict(lr.model, lr.optimizer) for name, lr in learners.items()}}


def whole_state(model: torch.nn.Module, precision: str) -> dict[str, torch.Tensor]:
    """The model's whole tensors on rank 0 (on the CPU, in the compute dtype; empty on the other ranks)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return ckpt.export_tensors(model, state, precision)


def save(run_dir: Path, step: int, *, learners: dict[str, Learner], precision: str, tokenizer,
         trainer_state: dict, rank_state: dict, counters: dict, config_yaml: str,
         extra_files: dict | None = None) -> Path:
    """Every rank writes its shards and `rank_state` (what it alone holds: its RNG, its shards of old versions);
    rank 0 the HF exports, the trainer state and the manifest."""
    root, final, tmp = ckpt.checkpoint_paths(run_dir, step)
    if distributed.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "ranks").mkdir(parents=True)
    distributed.barrier()
    failed = None
    try:  # a rank that fails its part (a full disk) must not leave the others waiting at the next collective
        dcp.save(sharded_state(learners), checkpoint_id=tmp / ckpt.SHARDS)
        torch.save(rank_state, ckpt.rank_state_path(tmp, distributed.rank()))
    except (Exception, CheckpointException) as err:  # DCP's own (a BaseException) carries every rank's failure
        failed = write_failure(err, distributed.rank())
    failures = list(dict.fromkeys(f for f in distributed.gather_objects(failed) if f))  # DCP's: on every rank
    if failures:
        error = str(ckpt.write_error(RuntimeError("; ".join(failures)), root, final, tmp)) \
            if distributed.is_main() else None
        raise ckpt.CheckpointError(distributed.from_main(error))
    exports = {name: whole_state(lr.model, precision) for name, lr in learners.items()}
    distributed.barrier()  # every rank's part is on disk
    error = None
    if distributed.is_main():
        try:
            ckpt.write_folder(tmp, {name: lr.model for name, lr in learners.items()}, tokenizer, trainer_state,
                              counters, config_yaml, state_dicts=exports, extra_files=extra_files)
            ckpt.publish_folder(root, final, tmp)
        except Exception as err:  # as in ckpt.save_checkpoint
            error = str(ckpt.write_error(err, root, final, tmp))
    error = distributed.from_main(error)
    if error:
        raise ckpt.CheckpointError(error)
    return final


def write_failure(err: BaseException, rank: int) -> str:
    """What failed on which rank, in a line; DCP's CheckpointException holds each failing rank's exception."""
    if isinstance(err, CheckpointException):
        return "; ".join(write_failure(wrapped[0], r) for r, wrapped in sorted(err.failures.items()))
    return f"rank {rank}: {getattr(err, 'strerror', None) or err}"


def restore(checkpoint: Path, learners: dict[str, Learner], world_size: int) -> dict:
    """Load every learner's shards and optimizer state; returns this rank's own state (`ckpt.load_rank_state`)."""
    if not ckpt.is_sharded(checkpoint):
        raise ckpt.CheckpointError(f"{checkpoint} was written by one process; resume it without --nproc (or start "
                                   "a new run with several)")
    if world_size != distributed.size():
        raise ckpt.CheckpointError(f"{checkpoint} was written by {world_size} processes, and each rank's RNG "
                                   f"resumes as it was; resume it with --nproc {world_size}")
    state = sharded_state(learners)
    dcp.load(state, checkpoint_id=checkpoint / ckpt.SHARDS)
    for name, lr in learners.items():
        set_model_state_dict(lr.model, state["models"][name])
        set_optimizer_state_dict(lr.model, lr.optimizer, state["optimizers"][name])
    return ckpt.load_rank_state(checkpoint, distributed.rank())
