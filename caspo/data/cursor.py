"""A resumable stream of item indices: a fresh shuffle of the dataset at every pass."""

from __future__ import annotations

import hashlib

import torch

from caspo.config import ConfigError

HASHED, SUMMED = "hashed", "seed+epoch"  # SUMMED: checkpoints written before the hash


def pass_seed(seed: int, epoch: int) -> int:
    """The seed of one pass's shuffle: the run seed for the first pass, a hash of (seed, epoch) for each later
    one. Not seed + epoch: with that, run seed 1 would walk run seed 0's passes one pass later, and the
    replicates of an experiment would share their data order. The hashes are 63-bit, so no later pass of one
    run takes another run's first-pass seed."""
    if epoch == 0:
        return seed
    key = f"prompt-cursor/{seed}/{epoch}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # fits int64


class PromptCursor:
    """Yields item indices in a permutation reshuffled each epoch (seeded by `pass_seed`).

    The state is just (epoch, position), so a checkpointed cursor resumes exactly where it was. A checkpoint
    from before the hashed seeds (its state names no `order`) goes on with seed + epoch, as it began.
    """

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError(f"num_items={num_items}: the dataset is empty")
        self.num_items = num_items
        self.seed = seed
        self._epoch = 0
        self.position = 0  # items of the current epoch's permutation already taken
        self._perm = None  # permutation of the current epoch, built on demand
        self.order = HASHED  # how a pass's seed is made

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self._epoch

    def permutation(self, epoch: int) -> list[int]:
        # torch's CPU generator gives the same permutation on every platform and process
        seed = pass_seed(self.seed, epoch) if self.order == HASHED else self.seed + epoch
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def take(self, n: int) -> list[int]:
        """The next n indices; a take that crosses the end of a pass continues into the next one."""
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        out = []
        while len(out) < n:
            if self._perm is None:
                self._perm = self.permutation(self._epoch)
            chunk = self._perm[self.position:self.position + n - len(out)]
            out.extend(chunk)
            self.position += len(chunk)
            if self.position == self.num_items:
                self._epoch, self.position, self._perm = self._epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed,
                "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_items", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"the checkpoint's prompt stream has {key}={state[key]}, this run's has "
                                  f"{getattr(self, key)}: a resumed run continues the same stream, so resume with the "
                                  "run's own train.seed and data settings (its config.yaml)")
        if not 0 <= state["position"] < self.num_items or state["epoch"] < 0:
            raise ValueError(f"invalid cursor state {state}")
        self._epoch, self.position, self._perm = state["epoch"], state["position"], None
        self.order = state.get("order", SUMMED)
