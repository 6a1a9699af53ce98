"""CASPO's periodic refresh: RL in segments of N steps, a fresh prefix value model between them.

`method.caspo.refresh_every=N` turns a run into a pipeline over checkpoints (DESIGN.md,
decision 8). After RL step n = N, 2N, … (never after the last step):

    stop     checkpoint step_n, the exact training state           (the loop saves it)
    collect  Monte Carlo labels of the checkpoint's exported policy with the run's sampler
                                                     -> <run>/refresh/step_n/labels.jsonl
    train    a fresh value model, φ₀ = frozen reference = that policy, as phase 1 starts from
             the policy that made its labels           -> <run>/refresh/step_n/value/
    resume   restore the checkpoint (weights, optimizer, scheduler, step, cursor, RNG, version;
             the KL reference stays the original base), then load the new value model

Phase 0: a refreshed run given no value model (method.caspo.value_model empty) labels the
base policy and trains the first one before step 1, in <run>/refresh/step_000000/, with the
same collection and training and β = the phase-1 default (10).

With several processes every rank collects its shard of the labels (prompts r, r + N, …) and
rank 0 merges them into the unsharded collection's file; the value model trains sharded on
every rank (as `caspo value train --nproc N`), and the run shards it as it shards its own models.

Every checkpoint records its value model's source, so a run resumed after a refresh
continues with the refreshed model. `refresh/step_n/refresh.json` is written last: a run
resumed at a refresh step reuses finished artifacts (or only the labels, if the value
training was cut short), provided they were made under this run's conditions.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from caspo.config import Config
from caspo.models.policy import load_policy
from caspo.models.provenance import label_provenance
from caspo.runlog import console
from caspo.segment import splitter_name
from caspo.train import distributed, loop
from caspo.train.step_values import ValueSource
from caspo.train.timers import PhaseTimer
from caspo.train.trainer import Trainer, restore
from caspo.value.collect import CollectSpec, collect, refresh_seed_step
from caspo.value.labels import LabelFileError, read_label_file
from caspo.value.shards import merge_shards, shard_path
from caspo.value.train import TrainSpec, train_value

MARKER = "refresh.json"


class Refresh:
    """The training loop's hook between segments (`caspo.train.loop.train(cfg, refresh=Refresh(cfg))`)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def before_first(self, cfg: Config) -> Config:
        if cfg.method.caspo.value_model:
            return cfg
        self.cfg = first_value_model(cfg)
        return self.cfg

    def due(self, step: int) -> bool:
        return due(self.cfg, step)

    def record_at(self, step: int) -> Callable[[dict], bool]:
        return record_at(step)

    def __call__(self, tr: Trainer, checkpoint: Path) -> dict:
        return refresh(tr, checkpoint)


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> dict:
    """A training run, with CASPO's refreshes when method.caspo.refresh_every asks for them (and the
    first value model made first, when none is given)."""
    return loop.train(cfg, resume, refresh=Refresh(cfg) if cfg.method.caspo.refresh_every else None,
                      overwrite=overwrite)


def first_value_model(cfg: Config) -> Config:
    """Phase 0: label the base policy and train the run's first value model (or reuse a finished one);
    returns the config with method.caspo.value_model pointing at it."""
    from caspo.models.policy import resolve_device, resolve_model_path
    from caspo.models.prefix_value import DEFAULT_BETA
    from caspo.models.tokenizer import load_tokenizer

    policy = resolve_model_path(cfg.model.policy, cfg.model.revision)
    folder = refresh_dir(cfg.train.output_dir, 0)
    provenance = label_provenance(cfg, load_tokenizer(policy), load_policy(policy)).to_dict()
    want = conditions(cfg, DEFAULT_BETA, 0, provenance)
    summary, reused = artifacts(cfg, DEFAULT_BETA, str(resolve_device(cfg.model.device)), 0, policy, folder, want,
                                at_checkpoint=cfg.model)
    console.print(f"phase 0: {summary['label_rows']} labelled prefixes of the base policy, value model "
                  f"val ρ {summary['val_spearman']:.3f} -> {folder / 'value'}"
                  + (f" (reused: {reused})" if reused != "none" else ""))
    caspo = replace(cfg.method.caspo, value_model=str(folder / "value"))
    return replace(cfg, method=replace(cfg.method, caspo=caspo))


def due(cfg: Config, step: int) -> bool:
    """Is a refresh due after `step` outer steps? Every refresh_every steps, never after the last."""
    every = cfg.method.caspo.refresh_every
    return every > 0 and 0 < step < cfg.train.steps and step % every == 0


def refresh_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir).resolve() / "refresh" / f"step_{step:06d}"


def collect_spec(cfg: Config) -> CollectSpec:
    c = cfg.method.caspo
    return CollectSpec(prompts=c.refresh_prompts, k=c.refresh_k, j=c.refresh_j, boundaries=c.refresh_boundaries,
                       state_temperature=c.refresh_state_temperature or None, pairing=c.refresh_pairing)


def train_spec(cfg: Config, beta: float) -> TrainSpec:
    """Value training as phase 1 does it; β stays the run's, so the value scale does not jump."""
    c = cfg.method.caspo
    return TrainSpec(beta=beta, lr=c.refresh_lr, epochs=c.refresh_epochs, batch_size=c.refresh_batch_size,
                     micro_batch_size=cfg.train.micro_batch_size, val_split="prompt",
                     val_fraction=c.refresh_val_fraction, seed=cfg.train.seed,
                     max_train_prefix_len=c.refresh_max_train_prefix_len)


def conditions(cfg: Config, beta: float, step: int, provenance: dict) -> dict:
    """Everything the artifacts of the refresh after `step` depend on; reuse needs all of it equal."""
    return {"collect": asdict(collect_spec(cfg)), "train": asdict(train_spec(cfg, beta)),
            "splitter": splitter_name(cfg), "seed": cfg.train.seed, "seed_step": refresh_seed_step(step),
            "provenance": provenance}


def labels_match(header: dict, want: dict) -> bool:
    """Was this label file collected under the conditions `want`?"""
    sizes = ("prompts", "k", "j", "boundaries", "state_temperature")
    return (all(header.get(k) == want["collect"][k] for k in sizes)
            and header.get("pairing", "all") == want["collect"]["pairing"]  # files from before pairings: all
            and all(header.get(k) == want[k] for k in ("splitter", "seed", "seed_step", "provenance")))


def record_at(step: int) -> Callable[[dict], bool]:
    """Picks the metrics.jsonl line of the refresh after `step` (a run resumed there writes it again)."""
    return lambda record: "refresh_value_model" in record and record["step"] == step


def refresh(tr: Trainer, checkpoint: Path) -> dict:
    """Label, train a fresh value model (or reuse finished artifacts), resume from `checkpoint` with it.

    `checkpoint` must hold the trainer's current state (the loop has just saved or restored it).
    Returns the run-log record of this refresh.
    """
    step = tr.step
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    if saved != step:
        raise ValueError(f"refresh after step {step} needs that step's checkpoint; {checkpoint} holds step {saved}")
    policy = str((checkpoint / "policy").resolve())
    folder = refresh_dir(tr.cfg.train.output_dir, step)  # the run's, not a rank's log folder
    timer = PhaseTimer()
    with timer("t_refresh"):
        provenance = label_provenance(tr.cfg, tr.tokenizer, load_policy(policy)).to_dict()
        want = conditions(tr.cfg, tr.method_state.model.beta, step, provenance)
        if not tr.engine.asleep:  # its cache and weights: the labelling engine's and φ's training's memory
            tr.engine.sleep(weights=True)
        summary, reused = artifacts(tr.cfg, tr.method_state.model.beta, str(tr.device), step, policy, folder, want)
        gc.collect()  # φ's training left its models in reference cycles
        tr.engine.wake()
        restore(tr, checkpoint)  # optimizer, scheduler, step, cursor, RNG and weights as saved; publishes them
        tr.method_state.install(ValueSource(str(folder / "value"), policy))
    console.print(f"refresh after step {step}: {summary['label_rows']} labelled prefixes, value model "
                  f"val ρ {summary['val_spearman']:.3f} -> {folder / 'value'}"
                  + (f" (reused: {reused})" if reused != "none" else ""))
    stats = summary["collect_stats"]  # the tokens generated to label: base rollouts and their continuations
    # labels reused from before base rollouts were counted leave the figure out (the report: "not recorded")
    tokens = {"refresh_tokens": stats["base_tokens"] + stats["mc_tokens"]} if "base_tokens" in stats else {}
    return {"step": step, "refresh_label_rows": summary["label_rows"], **tokens,
            "refresh_val_spearman": summary["val_spearman"], "refresh_reused": reused,
            "refresh_value_model": str(folder / "value"), **timer.reset()}


def artifacts(cfg: Config, beta: float, device: str, step: int, policy: str, folder: Path, want: dict,
              at_checkpoint=None) -> tuple[dict, str]:
    """The refresh's summary and what was reused: "all" (finished artifacts), "labels", or "none".

    The labels are collected from `policy` (the checkpoint's export; `at_checkpoint`, the model section
    to collect with, defaults to the run's with that policy and no hub pin)."""
    marker = folder / MARKER
    labels, value = folder / "labels.jsonl", folder / "value"
    reused = distributed.on_main(reusable, folder, want)  # rank 0 reads (and clears) for every rank
    if reused == "all":
        return json.loads(marker.read_text()), "all"
    timer = PhaseTimer()
    if reused == "none":
        with timer("collect"):
            if at_checkpoint is None:
                at_checkpoint = replace(cfg.model, policy=policy, revision=None)  # the pin is the base policy's
            collect_labels(replace(cfg, model=at_checkpoint), collect_spec(cfg), labels, want)
    header = read_label_file(labels).header
    # a value training cut short leaves a partial folder
    distributed.on_main(shutil.rmtree, value, True)
    with timer("train"):
        try:
            trained = train_value(labels, policy, value, train_spec(cfg, beta), device)
        except (ValueError, RuntimeError) as err:
            raise RuntimeError(
                f"refresh after step {step}: no value model could be trained on {labels}: {err}\n"
                "label more prefixes (method.caspo.refresh_prompts, refresh_k, refresh_boundaries) or hold out "
                "more prompts (method.caspo.refresh_val_fraction)") from err
    summary = {"step": step, "checkpoint_policy": policy, "labels": str(labels), "value_model": str(value),
               "label_rows": header["rows"], "collect_stats": header["stats"],
               "val_spearman": trained["best"]["spearman"], "train_rows": trained["train_rows"],
               "val_rows": trained["val_rows"], "seconds": timer.reset(), "conditions": want}
    distributed.on_main(write_json, marker, summary)  # last: its presence says the artifacts are complete
    return summary, reused


def reusable(folder: Path, want: dict) -> str:
    """What of the refresh's artifacts in `folder` can be reused under the conditions `want`: "all", "labels" or
    "none"; a marker of other conditions is removed."""
    marker = folder / MARKER
    if marker.is_file():
        if json.loads(marker.read_text())["conditions"] == want:
            return "all"
        console.print(f"refresh artifacts in {folder} were made under other conditions; making them again")
        marker.unlink()
    return "labels" if reusable_labels(folder / "labels.jsonl", want) else "none"


def collect_labels(cfg: Config, spec: CollectSpec, out: Path, want: dict) -> None:
    """The refresh's label file; with several processes each rank collects its shard and rank 0 merges them
    (the seeds make the merged file the one process's) and removes the shards. A rank's failure is raised on
    every rank."""
    n = distributed.size()
    if n == 1:
        collect(cfg, spec, out, splitter=want["splitter"], seed_step=want["seed_step"])
        return
    r, error = distributed.rank(), None
    try:
        collect(cfg, spec, shard_path(out, r, n), shard=(r, n), splitter=want["splitter"],
                seed_step=want["seed_step"])
    except Exception as err:  # every rank must reach the gather below
        error = f"{type(err).__name__}: {err}"
    failed = [(rank, e) for rank, e in enumerate(distributed.gather_objects(error)) if e is not None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]}'s shard of the refresh's labels failed: {failed[0][1]}")
    distributed.on_main(merge_shards, out, n)


def reusable_labels(path: Path, want: dict) -> bool:
    """A complete label file (they are written atomically) collected under the conditions `want`."""
    if not path.is_file():
        return False
    try:
        header = read_label_file(path).header
    except LabelFileError as err:
        console.print(f"collecting the labels again: {err}")
        return False
    if not labels_match(header, want):
        console.print(f"collecting the labels again: {path} was collected under other conditions")
        return False
    return True


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
