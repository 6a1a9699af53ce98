"""The engine a preset asks for: `rollout.backend` decides, nothing is chosen at run time."""

from __future__ import annotations

import torch

from caspo.config import Config
from caspo.train.precision import compute_dtype


def engine_dtype(cfg: Config) -> torch.dtype:
    return compute_dtype(cfg.train.precision if cfg.rollout.dtype == "auto" else cfg.rollout.dtype)


def build_engine(cfg: Config, policy: torch.nn.Module, tokenizer, max_seq_len: int):
    r = cfg.rollout
    if r.backend == "hf":
        from caspo.rollout.hf import HFEngine

        return HFEngine(policy, pad_token_id=tokenizer.pad_token_id, max_batch=r.max_batch,
                        decode=tokenizer.decode, dtype=engine_dtype(cfg))
    if r.backend == "native":
        from caspo.rollout.native import NativeEngine

        device = next(policy.parameters()).device
        sizing = ({"gpu_memory_fraction": r.gpu_memory_fraction} if device.type == "cuda" else
                  {"capacity_tokens": r.capacity_tokens or max_seq_len * (r.max_batch or cfg.responses_per_step)})
        return NativeEngine(policy, max_seq_len=max_seq_len, max_running=r.max_batch or None,
                            cuda_graphs=r.cuda_graphs, dtype=engine_dtype(cfg), device=device,
                            decode=tokenizer.decode, **sizing)
    raise ValueError(f"rollout.backend={r.backend!r}; use hf or native")
