"""Checkpoints: an HF policy folder plus the trainer state, written atomically.

    <run>/checkpoints/step_000010/policy/            save_pretrained folder (+ tokenizer)
    <run>/checkpoints/step_000010/trainer_state.pt   optimizer, scheduler, loss scale, RNG, cursor,
                                                     counters, fp32 master weights (if not fp32 export)
    <run>/checkpoints/step_000010/trainer_state.json the counters, readable
    <run>/checkpoints/step_000010/config.yaml        the resolved config of the run
    <run>/checkpoints/step_000010/manifest.json      sha256 and size of every file above, checked at resume
    <run>/checkpoints/latest                         name of the newest complete checkpoint

A run of several processes writes the same folder, with the trained models' weights and
optimizer states sharded by `torch.distributed.checkpoint` (DCP) and each rank's RNG apart:

    <run>/checkpoints/step_000010/shards/            DCP: {"models": {name: ...}, "optimizers": {name: ...}}
    <run>/checkpoints/step_000010/ranks/rank_1.pt    rank 1's RNG states
    <run>/checkpoints/step_000010/policy/            the HF export, written by rank 0 from the whole tensors

A checkpoint is built in a temporary folder and renamed into place; `latest` is
replaced last, so a crash at any moment leaves the previous checkpoint loadable.
The trainer state loads with `torch.load(weights_only=True)`: tensors and plain
containers, plus numpy's RNG state (`SAFE_GLOBALS`), so a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from caspo.models.tokenizer import save_tokenizer
from caspo.precision import compute_dtype

LATEST = "latest"
MANIFEST = "manifest.json"
SHARDS = "shards"  # the DCP folder of a checkpoint written by several processes
# what numpy's RNG state (a tuple holding a uint32 array) unpickles through, and nothing else
_multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray  # numpy 2 | 1
SAFE_GLOBALS = [_multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or not a checkpoint."""


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, *, models: dict, tokenizer, trainer_state: dict,
                    counters: dict, config_yaml: str | None = None, state_dicts: dict | None = None,
                    extra_files: dict | None = None) -> Path:
    """Write `models` (name -> HF module; `state_dicts`, name -> tensors, replaces a model's own, as its export
    in the compute dtype; `extra_files`, name -> file name -> text, go beside it) and the trainer state; returns
    the checkpoint folder.
    A write that fails (a full disk, a lost mount) removes the partial folder and raises CheckpointError;
    the previous checkpoint and `latest` are untouched."""
    root, final, tmp = checkpoint_paths(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_folder(tmp, models, tokenizer, trainer_state, counters, config_yaml, state_dicts, extra_files)
    except Exception as err:  # OSError, and the writers' own (torch's RuntimeError, SafetensorError) on a full disk
        raise write_error(err, root, final, tmp) from err
    publish_folder(root, final, tmp)
    return final


def checkpoint_paths(run_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    """(checkpoints folder, the step's folder, the temporary folder it is built in)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    return root, root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"


def write_error(err: Exception, root: Path, final: Path, tmp: Path) -> CheckpointError:
    shutil.rmtree(tmp, ignore_errors=True)
    previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else "none"
    why = getattr(err, "strerror", None) or err
    return CheckpointError(f"writing checkpoint {final.name} to {root} failed ({why}); the previous checkpoint "
                           f"({previous}) is intact: free space and resume from it")


def publish_folder(root: Path, final: Path, tmp: Path) -> None:
    """Rename the finished (and synced) folder into place, then point `latest` at it; each rename is synced
    before the next, so after a power loss `latest` never names a folder whose files did not reach the disk."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    sync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    sync_dir(root)


def sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder (the entries naming them)."""
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in folders:
        sync_dir(path)


def export_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """`state` (the model's whole tensors) as the model is published: on the CPU, a tensor at a time, in the
    compute dtype, and a tied parameter (the LM head that is the embedding) once, under its first name, as
    save_pretrained writes a whole model (copies gathered from shards no longer share storage to tell it)."""
    first = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    dtype = compute_dtype(precision)
    return {k: v.detach().cpu().to(dtype) if v.is_floating_point() else v.detach().cpu()
            for k, v in state.items() if k not in tied}


def record_dtype(folder: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """config.json's `dtype` as the weights written: save_pretrained takes it from the live model's parameters
    (a sharded model's fp32 masters), so a bf16 export would load at fp32 with dtype="auto"."""
    dtype = next((v.dtype for v in state_dict.values() if v.is_floating_point()), None)
    if dtype is None:
        return
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_folder(folder: Path, models: dict, tokenizer, trainer_state: dict, counters: dict,
                 config_yaml: str | None, state_dicts: dict | None = None, extra_files: dict | None = None) -> None:
    """`state_dicts` (name -> whole state dict) replaces a model's own, as an export in the compute dtype."""
    folder.mkdir(exist_ok=True)  # a sharded checkpoint's folder holds its shards already
    for name, model in models.items():
        state_dict = (state_dicts or {}).get(name)
        model.save_pretrained(folder / name, safe_serialization=True, state_dict=state_dict)
        if state_dict is not None:
            record_dtype(folder / name, state_dict)
        if tokenizer is not None:
            save_tokenizer(tokenizer, folder / name)
        for file_name, text in (extra_files or {}).get(name, {}).items():
            (folder / name / file_name).write_text(text)
    torch.save(trainer_state, folder / "trainer_state.pt")
    (folder / "trainer_state.json").write_text(json.dumps(counters, indent=2) + "\n")
    if config_yaml is not None:
        (folder / "config.yaml").write_text(config_yaml)
    (folder / MANIFEST).write_text(json.dumps(file_manifest(folder), indent=1, sort_keys=True) + "\n")
    sync_tree(folder)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder / checkpoints folder whose `latest` names one."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).exists():
            return latest_checkpoint(root)
    if (path / "trainer_state.pt").exists():
        return path
    raise FileNotFoundError(f"no checkpoint at {path} (expected a step_* folder or a run with checkpoints/latest)")


def latest_checkpoint(root: Path) -> Path:
    """The folder `root/latest` names; CheckpointError when it names none (damaged, empty, or a folder that is
    gone), saying which checkpoints are there to resume from instead."""
    pointer = root / LATEST
    steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    instead = (f"pass --resume {root}/step_N (there: {', '.join(steps)})" if steps else
               f"{root} holds no step_* checkpoint folder to resume from")
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is not UTF-8 text (it should name a checkpoint folder): it is damaged; "
                              f"resume from an earlier checkpoint: {instead}") from None
    if not name:
        raise CheckpointError(f"{pointer} is empty (it should name a checkpoint folder); {instead}")
    if not (root / name).is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is missing; {instead}")
    return root / name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(folder: Path) -> dict[str, dict]:
    """relative path -> {sha256, bytes} for every file under `folder` but the manifest itself."""
    return {str(p.relative_to(folder)): {"sha256": sha256(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def verify_checkpoint(ckpt: Path) -> None:
    """The manifest readable, and every file of it present with its size and checksum."""
    manifest_path = ckpt / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {MANIFEST} ({type(err).__name__}): it is "
                              "incomplete or not a checkpoint; resume from an earlier checkpoint") from err
    entry = {"sha256": str, "bytes": int}
    if not (isinstance(manifest, dict) and "trainer_state.pt" in manifest and all(
            isinstance(want, dict) and all(type(want.get(k)) is t for k, t in entry.items())
            for want in manifest.values())):
        raise CheckpointError(f"{manifest_path} is damaged (it should map every file of the checkpoint, "
                              "trainer_state.pt among them, to its sha256 and bytes); resume from an earlier "
                              "checkpoint")
    for name, want in manifest.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {name} is missing; resume from an earlier "
                                  "checkpoint")
        if path.stat().st_size != want["bytes"] or sha256(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted: {name} does not match its checksum in "
                                  f"{MANIFEST}; resume from an earlier checkpoint")


def load_trainer_state(ckpt: Path) -> dict:
    """The trainer state, unpickled with weights_only=True (tensors, containers, numpy's RNG state)."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(ckpt / "trainer_state.pt", weights_only=True)
    except Exception as err:  # a truncated file, or a pickle that is more than tensors and containers
        raise CheckpointError(f"{ckpt / 'trainer_state.pt'} cannot be loaded ({err}); resume from an earlier "
                              "checkpoint") from err


def check_state(ckpt: Path, state, keys, where: str = "") -> None:
    """CheckpointError unless `state` (the trainer state, or one of its entries: `where`) is a dict holding
    every one of `keys`: a damaged file, or one of another caspo version."""
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else None
    if missing is None or missing:
        what = "is not a dict" if missing is None else f"lacks {', '.join(map(str, missing))}"
        raise CheckpointError(f"{ckpt / 'trainer_state.pt'}{f' ({where})' if where else ''} {what}: it is damaged "
                              "or written by another caspo version; resume from an earlier checkpoint")


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDS).is_dir()


def rank_state_path(ckpt: Path, rank: int) -> Path:
    return ckpt / "ranks" / f"rank_{rank}.pt"


def load_rank_state(ckpt: Path, rank: int) -> dict:
    """What rank `rank` alone held: {"rng": its RNG states, "snapshots": its shards of the engine's old versions}."""
    path = rank_state_path(ckpt, rank)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no state for rank {rank} ({path.name}); resume it with the "
                              "number of processes that wrote it")
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        state = torch.load(path, weights_only=True)
    return state if "rng" in state else {"rng": state, "snapshots": {}}  # written when it held the RNG alone
