"""A run's folder: what a fresh run may overwrite, what a resume starts from, what a model written into a folder
would replace, and how a run that stops itself says so."""

from __future__ import annotations

import shutil
from pathlib import Path

from caspo.config import Config, ConfigError
from caspo.runlog import console
from caspo.train import checkpoint as ckpt

MODEL_FILES = ("config.json", "manifest.json", "*.safetensors")  # what makes a folder a model or a checkpoint


class RunStopped(RuntimeError):
    """The run stopped itself: its last good checkpoint is kept, the message says why and what to do."""


RUN_FILES = ("checkpoints", "metrics.jsonl", "samples.jsonl", "refresh", "curves.png", "run.json", "status.json",
             "timing.json", "timing.md", "tensorboard", "wandb", "ranks", "eval", "config.yaml")


def prepare_run_dir(cfg: Config, resume: str | None, overwrite: bool) -> Path | None:
    """The checkpoint to resume from, if any, checked before anything is written. A fresh run, or one resumed
    from another run's checkpoint (a branch), refuses a folder that holds a run unless `overwrite` (which
    removes that run's files)."""
    run_dir = Path(cfg.train.output_dir)
    if resume == "latest" and overwrite:
        raise ConfigError(both_error(run_dir))
    checkpoint = ckpt.resolve_checkpoint(run_dir if resume == "latest" else resume) if resume else None
    own = checkpoint is not None and checkpoint.resolve().parent == (run_dir / "checkpoints").resolve()
    if own and overwrite:
        raise ConfigError(both_error(run_dir))
    if own:
        later = sorted(p.name for p in checkpoint.parent.glob("step_*") if p.name > checkpoint.name)
        if later:
            console.print(f"[yellow]resuming from {checkpoint.name}: the later {', '.join(later)} will be "
                          "replaced as the run reaches their steps[/]")
        return checkpoint
    existing = [name for name in RUN_FILES if (run_dir / name).exists()]
    if existing and not overwrite:
        branch = f"resuming {checkpoint} into it would mix two runs; " if checkpoint else ""
        raise FileExistsError(f"{run_dir} already holds a run ({', '.join(existing)}); {branch}resume it with "
                              f"--resume latest, start over with --overwrite, or set train.output_dir to a new folder")
    for name in existing:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return checkpoint


def both_error(run_dir: Path) -> str:
    """--resume of the run's own checkpoint with --overwrite, which would remove that checkpoint. (A branch, the
    checkpoint of another run, may take --overwrite: it starts a new run in a folder that holds one.)"""
    return (f"--resume and --overwrite together: --resume continues the run in {run_dir}, --overwrite deletes it "
            "(its checkpoints among its files); give one: --resume to continue, --overwrite to start over")


def model_files(folder: str | Path) -> list[str]:
    """The files of `folder` that make it a model or checkpoint folder (MODEL_FILES): a model written there
    would replace them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted({p.name for pattern in MODEL_FILES for p in folder.glob(pattern)})


def refuse_model_folder(folder: str | Path, flag: str) -> None:
    """ConfigError if `folder` holds a model: the command writing to it needs --overwrite to replace it."""
    found = model_files(folder)
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ConfigError(f"{flag} {folder} holds a model already ({shown}); pass --overwrite to replace it, "
                          f"or another {flag}")


def load_during(loads: list[float]) -> dict:
    """The machine's 1-minute load average over this process's steps (it counts the run's own threads)."""
    if not loads:
        return {}
    return {"load_1m_mean": round(sum(loads) / len(loads), 2), "load_1m_max": round(max(loads), 2)}


