"""Training precision: fp32 master weights always; bf16 or fp16 compute under autocast.

    fp32  everything in fp32
    bf16  bf16 compute, fp32 master weights, fp32 gradients and optimizer state
    fp16  fp16 compute, fp32 master weights, a fixed loss scale (128 by default);
          a step whose gradients overflow is skipped and counted

The parameters the optimizer updates stay fp32, so a small update (lr 1e-6 × Adam's
unit step) is not rounded away as it would be on bf16 weights.
"""

from __future__ import annotations

import contextlib

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; use one of {list(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(precision))


def loss_scale(precision: str, scale: float = 128.0) -> float:
    """The factor a loss is scaled by before its backward: `scale` under fp16, 1 otherwise."""
    return scale if precision == "fp16" else 1.0


def all_finite(tensors) -> bool:
    """Whether every entry of `tensors` is finite (of a sharded DTensor, this process's shard), read from the
    device once."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # a DTensor's: its shard
    return not local or bool(torch.stack([torch.isfinite(t).all() for t in local]).all())


class LossScaler:
    """A fixed loss scale for fp16 (1 otherwise); counts the steps skipped for overflow."""

    def __init__(self, precision: str, scale: float = 128.0):
        self.scale = loss_scale(precision, scale)
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def unscale_and_check(self, params) -> bool:
        """Divide gradients by the scale; False (and the step counted as skipped) if any is not finite.
        Sharded gradients are checked on this process's shards."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.scale != 1.0:
            for g in grads:
                g.div_(self.scale)
        finite = all_finite(grads)
        if not finite:
            self.skipped_steps += 1
        return finite

    def state_dict(self) -> dict:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.skipped_steps = state["scale"], state["skipped_steps"]
