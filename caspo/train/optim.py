"""Optimizer and learning-rate schedule, built after any model wrapping; a model with both is a Learner."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from caspo.config import Config, OptimConfig


@dataclass
class Learner:
    """A model with its optimizer, schedule and gradient-norm clip."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float  # max global gradient norm of one optimizer step


def learner(model: torch.nn.Module, cfg: Config, lr: float | None = None, schedule: str | None = None,
            weight_decay: float | None = None, grad_clip: float | None = None) -> Learner:
    """Optimizer and schedule for `model` (built after the model is final, ready for FSDP2 wrapping first);
    the schedule spans every optimizer step of the run. What is not given comes from `cfg.optim`."""
    overrides = {"lr": lr, "weight_decay": weight_decay, "grad_clip": grad_clip}
    optim = dataclasses.replace(cfg.optim, **{k: v for k, v in overrides.items() if v is not None})
    optim = optim if schedule is None else dataclasses.replace(optim, schedule=schedule, warmup_steps=0,
                                                               warmup_ratio=0.0)
    updates = cfg.train.steps * cfg.train.epochs_per_rollout * (cfg.responses_per_step // cfg.train.minibatch_size)
    warmup = optim.warmup_steps or math.ceil(optim.warmup_ratio * updates)
    optimizer = build_optimizer(model.parameters(), optim)
    return Learner(model, optimizer, build_scheduler(optimizer, warmup=warmup, total=updates, schedule=optim.schedule,
                                                     shape=optim.warmup_shape), optim.grad_clip)


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    # foreach=False: the same kernels on every device and split, for exact resume
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, foreach=False)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               foreach=False)
    raise ValueError(f"optim.name={cfg.name!r}; use adamw or sgd")


def lr_multiplier(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float = 0.0,
                  shape: str = "linear") -> float:
    """A warmup over `warmup` updates, then constant, linear or cosine decay to min_ratio at `total`. The warmup
    rises linearly, (step + 1) / warmup, or as DeepSpeed's WarmupDecayLR by default, log(step + 1) / log(warmup)
    (at least 2 updates), whose linear decay (total − step) / (total − warmup) is the one here."""
    if warmup and step < warmup:
        if shape == "log":
            return math.log(step + 1) / math.log(max(2, warmup))
        if shape != "linear":
            raise ValueError(f"unknown warmup shape {shape!r}; use linear or log")
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use constant, linear or cosine")
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer, *, warmup: int, total: int, schedule: str, min_ratio: float = 0.0,
                    shape: str = "linear"):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup=warmup, total=total, schedule=schedule, min_ratio=min_ratio,
                                              shape=shape)
    )


@torch.no_grad()
def allocate_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's moments now, as zeros, so that an engine sizing its KV cache from free memory
    leaves room for them; the steps that follow are those of a fresh optimizer, bit for bit.

    One step at lr 0 on zero gradients lets torch build its own state (the parameters do not move:
    p·(1 − 0·wd) − 0·m/(√v + ε) = p), then the step counters go back to 0. SGD is left alone: its
    momentum buffer starts as the first gradient, not as zeros.
    """
    if not isinstance(optimizer, torch.optim.AdamW) or optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
        optimizer.state[p]["step"].zero_()
