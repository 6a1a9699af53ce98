"""Checkpoints: an HF policy folder plus the trainer state, written atomically.

    <run>/checkpoints/step_000010/policy/            save_pretrained folder (+ tokenizer)
    <run>/checkpoints/step_000010/trainer_state.pt   optimizer, scheduler, loss scale, RNG, cursor,
                                                     counters, fp32 master weights (if not fp32 export)
    <run>/checkpoints/step_000010/trainer_state.json the counters, readable
    <run>/checkpoints/step_000010/config.yaml        the resolved config of the run
    <run>/checkpoints/latest                         name of the newest complete checkpoint

A checkpoint is built in a temporary folder and renamed into place; `latest` is
replaced last, so a crash at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from caspo.models.tokenizer import save_tokenizer

LATEST = "latest"


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
                    counters: dict, config_yaml: str | None = None) -> Path:
    """Write `models` (name -> HF module) and the trainer state; returns the checkpoint folder."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, model in models.items():
        model.save_pretrained(tmp / name, safe_serialization=True)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp / name)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(counters, indent=2) + "\n")
    if config_yaml is not None:
        (tmp / "config.yaml").write_text(config_yaml)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder / checkpoints folder whose `latest` names one."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).exists():
            return root / (root / LATEST).read_text().strip()
    if (path / "trainer_state.pt").exists():
        return path
    raise FileNotFoundError(f"no checkpoint at {path} (expected a step_* folder or a run with checkpoints/latest)")


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)
