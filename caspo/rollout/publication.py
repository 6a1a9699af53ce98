"""Weight publication as a transaction: stage every tensor, check, then swap.

A publication that misses a name, brings an unknown name or a wrong shape (at
`load()`), or holds a NaN or Inf, raises and leaves the weights in service
untouched: a half-loaded or non-finite policy can never generate. Each tensor is
cast to the engine's dtype as it is staged, so what is checked is what will serve.
A sharded parameter (an FSDP2 DTensor) is gathered whole as it is staged, one
tensor at a time, so no more than one gathered tensor is alive beside the staged
copies; every rank stages the same names in the same order.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor


class PublicationError(RuntimeError):
    pass


def tensor_sums(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """name -> (float64 sum, sum of squares) of each tensor, computed where it lives."""
    out = {}
    for name in sorted(named):
        x = named[name].detach().double()
        total, squares = torch.stack([x.sum(), x.square().sum()]).cpu().tolist()
        out[name] = (total, squares)
    return out


def weights_digest(named: dict[str, torch.Tensor], sums: dict[str, tuple[float, float]] | None = None) -> str:
    """A checksum of named tensors: their names, shapes, dtypes and `tensor_sums`."""
    sums = tensor_sums(named) if sums is None else sums
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{sums[name][0]!r}:{sums[name][1]!r};".encode())
    return h.hexdigest()[:16]


class Publication:
    """Staging area for one versioned publication into `target`'s parameters."""

    def __init__(self, target: dict[str, torch.Tensor], version: int):
        self.target = target
        self.version = version
        self.staged: dict[str, torch.Tensor] = {}

    def load(self, named_tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in named_tensors.items():
            if isinstance(tensor, DTensor):  # a shard: every rank gathers the whole tensor here
                tensor = tensor.full_tensor()
            if name not in self.target:
                raise PublicationError(f"publication v{self.version}: unknown tensor {name!r}")
            want = self.target[name]
            if tuple(tensor.shape) != tuple(want.shape):
                raise PublicationError(
                    f"publication v{self.version}: {name} has shape {tuple(tensor.shape)}, expected {tuple(want.shape)}"
                )
            # Cast to the engine's compute dtype here, so what is checked is what will serve.
            self.staged[name] = tensor.detach().to(device=want.device, dtype=want.dtype, copy=True)

    def commit(self) -> str:
        missing = sorted(set(self.target) - set(self.staged))
        if missing:
            raise PublicationError(
                f"publication v{self.version} incomplete: {len(missing)} tensors never arrived (first: {missing[0]}); "
                "the previous weights stay in service"
            )
        sums = tensor_sums(self.staged)  # a NaN or Inf anywhere makes its tensor's sums non-finite
        bad = [name for name, pair in sums.items() if not all(map(math.isfinite, pair))]
        if bad:
            raise PublicationError(f"publication v{self.version}: {len(bad)} tensors hold NaN or Inf (first: "
                                   f"{bad[0]}); the previous weights stay in service")
        digest = weights_digest(self.staged, sums)
        with torch.no_grad():
            for name, tensor in self.staged.items():
                self.target[name].copy_(tensor)
        self.staged.clear()
        return digest


class PublishedWeights:
    """The publication side of an engine: `begin(version)`, `load(chunk)`..., `commit() -> digest`.

    An engine sets `self.version = 0` and `self._publication = None` and implements
    `_params()`, the tensors it serves, by name.
    """

    version: int
    _publication: Publication | None
    _released: dict[str, torch.Size] | None = None  # shapes of the weights freed or never filled

    def _params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # The engine's weights are its own copy of the policy's: while the trainer trains they can be
    # freed, and the next publication brings them back.
    def release_weights(self) -> None:
        """Free the served weights' storage; generating then needs a publication first."""
        params = self._params()
        if self._released is None:
            self._released = {name: p.shape for name, p in params.items()}
        for p in params.values():  # also those of an engine still awaiting its first publication
            p.data = p.data.new_empty(0)

    def await_publication(self) -> None:
        """Mark the weights as not yet filled (an engine built from a model's skeleton): generating needs a
        publication first."""
        self._released = {name: p.shape for name, p in self._params().items()}

    def reallocate_weights(self) -> None:
        """Give released weights their storage back (uninitialised: a publication fills it)."""
        if self._released is not None:
            for name, p in self._params().items():
                if p.numel() == 0 and self._released[name].numel():
                    p.data = p.data.new_empty(self._released[name])

    def check_weights(self) -> None:
        if self._released is not None:
            raise PublicationError("the engine holds no weights (released by sleep(weights=True), or built from a "
                                   "model's skeleton); publish the policy before generating")

    def begin(self, version: int) -> None:
        self._publication = Publication(self._params(), version)

    def load(self, named_tensors: dict[str, torch.Tensor]) -> None:
        if self._publication is None:
            raise PublicationError("load() before begin()")
        self._publication.load(named_tensors)

    def commit(self) -> str:
        """Check and swap in the staged tensors (copied in place, so captured graphs stay valid)."""
        if self._publication is None:
            raise PublicationError("commit() before begin()")
        publication, self._publication = self._publication, None
        digest = publication.commit()
        self.version = publication.version
        self._released = None  # every weight was staged, so every released one is filled again
        return digest

    def digest(self) -> str:
        return weights_digest(self._params())
