"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the models a run of several processes trains and scores.

How a model is sharded depends on how the code calls it:

    policy, reference   each decoder layer is a group; the rest (embeddings, final norm, LM head, tied or
                        not) is the group of a root wrapper, `Root`. The forward code reads the LM head's
                        weight directly (`caspo.models.forward.hidden_logprobs`), outside any module call, so
                        a call runs *through* the root: `call(model, fn, *args)` is `fn(model, *args)` inside
                        the root's forward, with every group of it gathered when used.
    learners            (a critic: a backbone and a head, each called as a module) each decoder layer, the
                        backbone and each head are groups, and are called as they are.

A looped model runs its layers `depth` times per token, so its layers are not groups of their own: the
whole model is one group. Every group reshards after its forward (no-grad passes leave nothing gathered).

Placement: rank 0 reads the models into host memory, the other ranks build them on the meta device (no
weights, `read_device`); `fully_shard` moves rank 0's groups to its card as it wraps them, and rank 0's whole
tensors are then broadcast one at a time, each rank keeping its shard (`fill_from_main`). So the host holds
one copy of each model, not one per rank, and no card holds a whole model beside its shards.

Precision: bf16 keeps fp32 parameters (the optimizer's masters), gathers them in bf16 for compute and
reduces gradients in fp32; fp32 is fp32 throughout. Gradients are *summed* over ranks (divide factor 1,
SUM collectives): each rank's loss is already normalised by the whole minibatch's counts, so the sum is
the single-process gradient (up to the order of the additions).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from caspo.batch import RolloutBatch
from caspo.models.looped import LoopedPreTrainedModel
from caspo.models.policy import attention_without_cudnn, is_skeleton
from caspo.precision import autocast
from caspo.train import distributed
from caspo.train.optim import Learner
from caspo.train.scoring import score_micro_batching

_ROOTS: "weakref.WeakKeyDictionary[torch.nn.Module, Root]" = weakref.WeakKeyDictionary()


class Root(torch.nn.Module):
    """The FSDP root of a model whose callers read parameters outside module calls."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args):
        return fn(self.model, *args)


def read_device(device: torch.device | str) -> torch.device:
    """Where the run's models are read: its device; with several processes, the host on rank 0 and the meta
    device (a skeleton, no weights) on the others, whose shards come from rank 0's copy when they are sharded.
    Read on the card, a 7B policy and its reference would take 61 GB there whole before any sharding; read on
    every rank's host, 61 GB per rank. On CUDA, attention runs without cuDNN either way."""
    device = torch.device(device)
    if device.type == "cuda":
        attention_without_cudnn()
    if not distributed.active():
        return device
    return torch.device("cpu") if distributed.is_main() else torch.device("meta")


def mixed_precision(precision: str, cast_inputs: bool = True) -> MixedPrecisionPolicy:
    if precision == "fp32":
        return MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):  # fp16: the loss scaler's overflow check is taken over every rank
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
                                    reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs)
    raise ValueError(f"train.precision={precision!r}; use fp32, bf16 or fp16")


def _mesh() -> DeviceMesh:
    """Every rank, on the process group's device: the rank's card under NCCL, the CPU under gloo. A model read
    into host memory moves to the card one group at a time as `fully_shard` wraps it, so no rank holds a whole
    model there. (FSDP2's default mesh is on the host's accelerator, which would move the models of a CPU run
    onto a GPU that the host happens to have.)"""
    return init_device_mesh(distributed.collective_device().type, (distributed.size(),))


def _group(module, precision: str, mesh: DeviceMesh, cast_inputs: bool = True) -> None:
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=mixed_precision(precision, cast_inputs))
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # SUM on every backend (gloo has no PREMUL_SUM)


def _layers(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(backbone).__name__} has no `layers` list to shard; several processes need a "
                        "decoder with one")
    return list(layers)


def shard_routed(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Shard a causal LM (the policy, the reference) in place, its weights rank 0's; its calls then go
    through `call`."""
    mesh, whole = _mesh(), main_state(model)
    if not isinstance(model, LoopedPreTrainedModel):
        for layer in _layers(model.get_decoder()):
            _group(layer, precision, mesh)
    root = Root(model)
    _group(root, precision, mesh, cast_inputs=False)  # the arguments are batches: their float tensors stay fp32
    _ROOTS[model] = root
    return fill_from_main(check_sharded(model), whole)


def shard_called(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Shard a model called as modules (a critic: `base_model`, then its head) in place, its weights rank 0's."""
    backbone, mesh, whole = model.base_model, _mesh(), main_state(model)
    if not isinstance(model, LoopedPreTrainedModel):
        for layer in _layers(backbone):
            _group(layer, precision, mesh)
    _group(backbone, precision, mesh)
    for child in model.children():
        if child is not backbone and any(True for _ in child.parameters()):
            _group(child, precision, mesh)
    return fill_from_main(check_sharded(model), whole)


def main_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's whole state of `model` (its tensors, not copies), taken before sharding replaces them by
    shards; {} on the other ranks, whose model is a skeleton."""
    if not distributed.is_main():
        return {}
    if is_skeleton(model):
        raise RuntimeError(f"rank 0's {type(model).__name__} has no weights (built on the meta device); rank 0 "
                           "reads every model that is sharded")
    return model.state_dict()


def fill_from_main(model: torch.nn.Module, whole: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Every rank's shards and buffers of a sharded `model` from rank 0's `whole` state (`main_state`): the
    tensors are broadcast one at a time (torch.distributed.checkpoint's `broadcast_from_rank0`), so no card holds
    more than one whole tensor at once. A skeleton gets its storage on the mesh's device first. Buffers are
    broadcast too: RoPE's inverse frequencies are in no state dict, and a skeleton's are empty."""
    device = distributed.collective_device()
    if is_skeleton(model):
        model.to_empty(device=device)
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)
    return model


def check_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, once every parameter is in a group: one outside all of them would stay whole and where it was
    read (on the host, for a model read there), and its gradient would not be reduced over the ranks."""
    whole = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if whole:
        raise RuntimeError(f"{type(model).__name__}'s parameters {', '.join(whole[:3])}"
                           f"{f' (and {len(whole) - 3} more)' if len(whole) > 3 else ''} are in no FSDP group; "
                           "shard the modules that hold them")
    return model


def call(model: torch.nn.Module, fn: Callable, *args):
    """`fn(model, *args)`, through the model's FSDP root when it has one."""
    root = _ROOTS.get(model)
    return fn(model, *args) if root is None else root(fn, *args)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (a collective: every rank calls it, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the model's parameters as this rank holds them: its shards of sharded ones."""
    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a copy of this rank's part of `param`, `local_copies`) as `param` is: sharded alike, on its device."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def rebuild(lr: Learner, model: torch.nn.Module) -> Learner:
    """The learner's optimizer and schedule again, over `model`'s (now sharded) parameters, with the same
    settings; built after wrapping, as every optimizer must be."""
    old = lr.optimizer
    accepted = inspect.signature(type(old)).parameters
    optimizer = type(old)([p for p in model.parameters() if p.requires_grad],
                          **{k: v for k, v in old.defaults.items() if k in accepted})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=list(lr.scheduler.lr_lambdas))
    return Learner(model, optimizer, scheduler, lr.grad_clip)


# ---------------------------------------------------------------- the same number of forwards on every rank


def micro_batches(batch: RolloutBatch, rows: torch.Tensor, size: int,
                  max_tokens: int = 0) -> Iterator[tuple[torch.Tensor, RolloutBatch, bool]]:
    """(row indices, micro-batch, real) over `rows`, as `RolloutBatch.micro_batches`; with several ranks,
    padded with stand-ins (real = False: a row twice, its loss to be multiplied by 0; two rows, as compiled
    blocks would build a graph of their own for one) up to the largest count of any rank, since every FSDP
    forward and backward is a collective."""
    if not distributed.active():
        for idx, micro in batch.micro_batches(size, rows, max_tokens):
            yield idx, micro, True
        return
    chunks = list(batch.micro_batches(size, rows, max_tokens))  # counted before any forward: they are collectives
    extra = distributed.all_max(len(chunks)) - len(chunks)
    for idx, micro in chunks:
        yield idx, micro, True
    stand_in = (rows[:1] if len(rows) else torch.zeros(1, dtype=torch.long)).repeat(2)
    for _ in range(extra):
        yield stand_in, batch.select(stand_in), False


@torch.no_grad()
def score_rows(model: torch.nn.Module, batch: RolloutBatch, cfg, fn: Callable[..., torch.Tensor],
               *args) -> torch.Tensor:
    """`fn(model, micro, *args)` -> [b, R] over the batch, each rank on its block of rows, gathered on all."""
    rows = distributed.my_rows(torch.arange(batch.size))
    out = torch.zeros((len(rows), batch.behaviour_logprobs.shape[1]), device=batch.behaviour_logprobs.device)
    for idx, micro, real in micro_batches(batch, rows, *score_micro_batching(cfg)):
        with autocast(cfg.train.precision, micro.input_ids.device):
            values = call(model, fn, micro, *args).float()
        if real:
            out[idx - rows[0], :micro.responses.shape[1]] = values
    return distributed.gather_rows(out, batch.size)
