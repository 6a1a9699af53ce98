"""Trackers beside metrics.jsonl (train.loggers): TensorBoard and Weights & Biases.

Each gets every number of every metrics.jsonl record at the record's step (tags grouped by prefix:
train/, time/, health/, memory/, eval/, bench/, refresh/), and per outer step a table of sample texts
(train.log_samples of them) and histograms of the batch's token advantages, of the update's ratios
π/π_old and of the ratio π_old/μ of the trainer's recomputed scores to the engine's behaviour scores (hist/).

    tensorboard   <run>/tensorboard/ (torch.utils.tensorboard); a resumed run purges the steps it redoes
    wandb         <run>/wandb/, offline unless train.wandb.mode=online; a resumed run rewinds its W&B run to
                  the checkpoint's step and logs the steps after it again
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Protocol

import torch

from caspo.config import Config, ConfigError, to_dict
from caspo.runlog import console

# tag group of a metric: the first prefix it starts with (the rest are train/)
GROUPS = (("t_", "time"), ("mem_", "memory"), ("eval_", "eval"), ("bench_", "bench"), ("refresh_", "refresh"),
          ("pass_at_g", "health"), ("response_len", "health"), ("steps_per_response", "health"),
          ("policy_tokens", "health"), ("value_tokens", "health"), ("truncated_frac", "health"))
SAMPLE_COLUMNS = ("prompt_id", "reward", "length", "finish_reason", "policy_version", "text")


def tag(key: str) -> str:
    group = next((g for prefix, g in GROUPS if key.startswith(prefix)), "train")
    return f"{group}/{key}"


def numbers(record: dict) -> dict[str, float]:
    """The record's finite and non-finite numbers (bools as 0/1), without its step."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class Tracker(Protocol):
    def log(self, record: dict) -> None:
        """Every number of one metrics.jsonl record, at record["step"]."""

    def log_batch(self, step: int, samples: list[dict], histograms: dict[str, torch.Tensor]) -> None:
        """One outer step's sample texts and value distributions."""

    def close(self) -> None: ...


def samples_markdown(samples: list[dict]) -> str:
    def cell(value) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ⏎ ")
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in SAMPLE_COLUMNS) + " |" for s in samples]
    return "\n".join(lines)


class TensorBoardTracker:
    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run writes the steps after start_step again: drop what an earlier process wrote there
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(tag(key), value, record["step"])
        self.writer.flush()

    def log_batch(self, step: int, samples: list[dict], histograms: dict[str, torch.Tensor]) -> None:
        if samples:
            self.writer.add_text("samples", samples_markdown(samples), step)
        for name, values in histograms.items():
            if values.numel():
                self.writer.add_histogram(f"hist/{name}", values.detach().float().cpu(), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def logged_before(run_dir: Path, run_id: str) -> bool:
    """Whether an earlier process of this run folder logged to the W&B run `run_id` (its files are in <run>/wandb/:
    offline-run-<time>-<id>, or run-<time>-<id>)."""
    return any((Path(run_dir) / "wandb").glob(f"*run-*-{run_id}"))


class WandbTracker:
    """A W&B run per caspo run folder. A resume from the checkpoint of step k rewinds it to step k (W&B's
    `resume_from`, SDK >= 0.17.1): W&B ignores a step below the one its run has reached, so a run continued as it
    was would keep an earlier process's steps after k and drop the ones done again. Where W&B refuses the rewind (on a
    server without the feature) the run is continued as it was, with a warning."""

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, start_step: int = 0):
        import wandb

        w = cfg.train.wandb
        self.wandb = wandb
        settings = dict(project=w.project, entity=w.entity, name=w.name or run_dir.name, dir=str(run_dir),
                        mode=w.mode, config=to_dict(cfg))
        if start_step and logged_before(run_dir, run_id):
            try:
                self.run = wandb.init(**settings, resume_from=f"{run_id}?_step={start_step}")
                return
            except Exception as err:  # W&B raises its own errors, which vary by version and server
                console.print(f"[yellow]W&B could not rewind run {run_id} to step {start_step} ({err}); it keeps "
                              f"the steps after {start_step} that an earlier process logged, and ignores them "
                              "when this run logs them again[/]")
        self.run = wandb.init(**settings, id=run_id, resume="allow")

    def log(self, record: dict) -> None:
        self.run.log({tag(k): v for k, v in numbers(record).items() if math.isfinite(v)}, step=record["step"])

    def log_batch(self, step: int, samples: list[dict], histograms: dict[str, torch.Tensor]) -> None:
        data: dict = {}
        if samples:
            data["samples"] = self.wandb.Table(columns=list(SAMPLE_COLUMNS),
                                               data=[[s.get(c) for c in SAMPLE_COLUMNS] for s in samples])
        for name, values in histograms.items():
            if values.numel():
                data[f"hist/{name}"] = self.wandb.Histogram(values.detach().float().cpu().numpy())
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def check_loggers(cfg: Config) -> None:
    """Before a run writes anything: the loggers it lists can be honoured."""
    loggers = cfg.train.loggers
    if "jsonl" not in loggers:
        raise ConfigError(f"train.loggers={loggers} leaves out jsonl: metrics.jsonl is the run's record (resume, "
                          "caspo report and caspo suite read it); list the others beside it, e.g. "
                          "train.loggers=[jsonl,tensorboard]")
    if "wandb" in loggers:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("train.loggers lists wandb, but wandb is not installed: pip install 'caspo[wandb]', "
                              "or drop wandb from train.loggers") from None
    if "tensorboard" in loggers:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("train.loggers lists tensorboard, but tensorboard is not installed: pip install "
                              "tensorboard (caspo's default install has it), or drop it from train.loggers") from None


def wandb_run_id(run_dir: Path, first_start: str) -> str:
    """One W&B run per caspo run folder: its resumes continue it; --overwrite (a new first start) begins anew."""
    return hashlib.sha256(f"{Path(run_dir).resolve()}|{first_start}".encode()).hexdigest()[:16]


def build_trackers(cfg: Config, run_dir: Path, start_step: int, first_start: str) -> list[Tracker]:
    check_loggers(cfg)
    trackers: list[Tracker] = []
    if "tensorboard" in cfg.train.loggers:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard", start_step))
    if "wandb" in cfg.train.loggers:
        trackers.append(WandbTracker(cfg, run_dir, wandb_run_id(run_dir, first_start), start_step))
    return trackers


class RunRecords:
    """metrics.jsonl and the trackers: every record goes to all of them."""

    def __init__(self, jsonl, trackers: list[Tracker]):
        self.jsonl, self.trackers = jsonl, trackers

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        for t in self.trackers:
            t.log(record)

    def batch(self, step: int, samples: list[dict], histograms: dict[str, torch.Tensor]) -> None:
        for t in self.trackers:
            t.log_batch(step, samples, histograms)

    def close(self) -> None:
        self.jsonl.close()
        for t in self.trackers:
            t.close()
