"""The engine a preset asks for: `rollout.backend` decides, nothing is chosen at run time."""

from __future__ import annotations

import torch

from caspo.config import Config, ConfigError
from caspo.data.templates import CHAT
from caspo.models.policy import resolve_model_path, stop_token_ids
from caspo.models.tokenizer import chat_turn_end_ids
from caspo.precision import compute_dtype
from caspo.rollout.base import SamplingParams


def engine_dtype(cfg: Config) -> torch.dtype:
    return compute_dtype(cfg.train.precision if cfg.rollout.dtype == "auto" else cfg.rollout.dtype)


def sampling_params(cfg: Config, tokenizer, policy: torch.nn.Module | None = None) -> SamplingParams:
    """The training sampler: every consumer (rollouts, Monte Carlo values, labels) uses this one. It stops on
    every EOS id of the policy's generation config (that of `policy`, else of `model.policy` at
    `model.revision`) and, with data.template=chat, on the token that ends the assistant's turn."""
    r = cfg.rollout
    source = policy if policy is not None else resolve_model_path(cfg.model.policy, cfg.model.revision)
    stops = stop_token_ids(source, tokenizer)
    if cfg.data.template == CHAT:
        stops = sorted({*stops, *chat_turn_end_ids(tokenizer)})
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          stop_token_ids=stops, stop_strings=list(r.stop))


def max_seq_len(cfg: Config) -> int:
    """The engine's longest sequence: a prompt and the longer of the rollout and eval budgets, or, for vineppo with
    `method.vineppo_context_tokens` set, its longest continuation (a prefix of up to a whole response, then up to
    rollout.max_new_tokens more, within that context). Other methods leave the setting unread: a preset that
    carries it for vineppo does not size their engines."""
    longest = cfg.data.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if cfg.method.name == "vineppo" and cfg.method.vineppo_context_tokens:
        continuation = cfg.data.max_prompt_tokens + 2 * cfg.rollout.max_new_tokens
        longest = max(longest, min(cfg.method.vineppo_context_tokens, continuation))
    return longest


def build_engine(cfg: Config, policy: torch.nn.Module, tokenizer, max_seq_len: int,
                 device: torch.device | None = None):
    """The engine of rollout.backend on `device` (the policy's by default: a sharded run reads its models on the
    host); refused when a sequence could run past the policy's context."""
    device = torch.device(device) if device is not None else next(policy.parameters()).device
    r = cfg.rollout
    context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if context and max_seq_len > context:
        raise ConfigError(f"a sequence may reach {max_seq_len} tokens (data.max_prompt_tokens plus the longest of "
                          "rollout.max_new_tokens, eval.max_new_tokens and VinePPO's continuations), past the "
                          f"policy's context of {context} (max_position_embeddings): lower them to fit")
    if r.backend == "hf":
        from caspo.rollout.hf import HFEngine

        return HFEngine(policy, pad_token_id=tokenizer.pad_token_id, max_batch=r.max_batch,
                        decode=tokenizer.decode, dtype=engine_dtype(cfg), device=device)
    if r.backend == "native":
        from caspo.rollout.native import NativeEngine

        if device.type != "cuda":  # options of the engine's CUDA path: refused before anything is built
            named = [name for name, on in (("rollout.cuda_graphs", r.cuda_graphs),
                                           ("rollout.shared_prefix_attention", r.shared_prefix_attention)) if on]
            if named:
                raise ConfigError(f"{' and '.join(named)}=true need a CUDA device; the policy is on {device}: "
                                  "set model.device=cuda or turn them off")
        # An explicit capacity wins on any device; otherwise a GPU share, or one step's requests on the CPU.
        if r.capacity_tokens:
            sizing = {"capacity_tokens": r.capacity_tokens}
        elif device.type == "cuda":
            sizing = {"gpu_memory_fraction": r.gpu_memory_fraction}
        else:
            sizing = {"capacity_tokens": max_seq_len * (r.max_batch or cfg.responses_per_step)}
        return NativeEngine(policy, max_seq_len=max_seq_len, max_running=r.max_batch or None,
                            admit_batch=r.admit_batch or None,
                            cuda_graphs=r.cuda_graphs, shared_prefix_attention=r.shared_prefix_attention,
                            dtype=engine_dtype(cfg), device=device,
                            decode=tokenizer.decode, **sizing)
    raise ValueError(f"rollout.backend={r.backend!r}; use hf or native")
