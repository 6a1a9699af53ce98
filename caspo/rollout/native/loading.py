"""Building a runner and loading its weights by name, from a live model's parameters or safetensors files.

The runner's parameters carry the Hugging Face names (`runner.py`), so a checkpoint and a publication of
the trainer's `named_parameters()` map one to one; a missing, unknown or misshapen name is an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file
from torch import nn

from caspo.rollout.native.runner import MLP, Attention, Runner
from caspo.rollout.native.spec import DecoderSpec


def read_checkpoint(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of a `save_pretrained` folder (sharded or not)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}; save the model with save_pretrained()")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def weights_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"the weights come in dtypes {sorted(map(str, dtypes))}; pass dtype= to choose one")
    return dtypes.pop()


def fused_modules(runner: nn.Module) -> list[Attention | MLP]:
    """The modules whose parameters are views of one fused weight (`fuse_linears`)."""
    return [m for m in runner.modules() if isinstance(m, (Attention, MLP))]


def build_runner(runner_class: type[Runner], spec: DecoderSpec, tensors: Mapping[str, torch.Tensor] | None, *,
                 dtype: torch.dtype, device: torch.device, max_seq_len: int) -> Runner:
    """A runner on `device` in `dtype`, with every parameter loaded by name from `tensors`; with None (a model's
    skeleton) its storage stays unfilled, and the weights come with the first publication."""
    with torch.device("meta"):
        runner = runner_class(spec, dtype)
    runner.to_empty(device=device).requires_grad_(False).eval()
    for module in fused_modules(runner):
        module.fuse()  # after to_empty, which gives every parameter its own storage
    if tensors is not None:
        load_weights(runner, tensors)
    runner.init_rope(max_seq_len)
    return runner


def load_weights(runner: Runner, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into the runner's parameters by name; any missing, unknown or misshapen name raises."""
    params = dict(runner.named_parameters())
    # Not weights of the computation: RoPE buffers some old checkpoints saved, and the head of a tied
    # model (transformers ties it to the embedding and ignores a stored copy too).
    ignored = {n for n in tensors if n.endswith("rotary_emb.inv_freq")}
    if runner.spec.tie_word_embeddings:
        ignored.add("lm_head.weight")
    unknown = sorted(set(tensors) - set(params) - ignored)
    missing = sorted(set(params) - set(tensors))
    if unknown or missing:
        raise ValueError(f"weights do not match the {runner.spec.family} runner: "
                         f"unknown {unknown[:5]}{'…' if len(unknown) > 5 else ''}, "
                         f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                 f"the runner expects {tuple(param.shape)}")
            param.copy_(tensor.detach())
