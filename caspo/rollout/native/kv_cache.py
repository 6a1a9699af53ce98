"""The engine-owned KV cache: one fixed slot of `max_seq_len` positions per running sequence.

Layout: a single tensor `[planes, layers, 2 (k, v), slots, kv_heads, max_seq_len, head_dim]`.

Why fixed slots rather than paged blocks: prefill attention is PyTorch's SDPA, which reads keys
and values as dense `[batch, kv_heads, length, head_dim]` tensors, and the decode kernel
(`decode_attention.py`) reads each row's keys from its slot as one contiguous run. With slots both
read the cache in place; with paged blocks every prefill would first gather each sequence's
blocks into such a tensor. The price is memory: a slot reserves `max_seq_len` positions
whatever the sequence's length. The allocation unit ("block" in `capacity_report`) is
therefore one slot of `max_seq_len` tokens.

Planes: `layer(plane, layer)` addresses the K/V of one (plane, layer) pair. An ordinary
decoder uses plane 0; a looped (recurrent-depth) decoder keeps one plane per loop, so each
loop's attention sees only that loop's keys of earlier tokens ("recurrence planes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caspo.device_memory import GIB, device_memory_bytes


class CacheDoesNotFit(torch.OutOfMemoryError):
    """The KV cache's share does not fit beside what the process already holds (weights, optimizer state)."""


@dataclass(frozen=True)
class CapacityReport:
    tokens: int  # token positions the cache holds: blocks × block_tokens
    blocks: int  # allocation units: one slot per running sequence
    block_tokens: int  # positions per block: max_seq_len
    bytes: int  # tokens × bytes_per_token
    bytes_per_token: int  # planes × layers × 2 × kv_heads × head_dim × element size
    planes: int = 1  # K/V planes per layer and position: a looped model's depth, 1 otherwise

    @property
    def token_planes(self) -> int:
        """(position, plane) pairs per layer: a looped model of depth d holds d·n for n positions."""
        return self.tokens * self.planes


class KVCache:
    def __init__(self, *, slots: int, max_seq_len: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, planes: int = 1):
        if slots < 1:
            raise ValueError(f"a KV cache needs at least one slot (got {slots})")
        self.shape = (planes, layers, 2, slots, kv_heads, max_seq_len, head_dim)
        self.planes, self.layers, self.slots, self.max_seq_len = planes, layers, slots, max_seq_len
        self.dtype, self.device = dtype, torch.device(device)
        self.kv: torch.Tensor | None = None
        self.allocate()

    @staticmethod
    def bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, planes: int = 1) -> int:
        return planes * layers * 2 * kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def slots_for(*, max_seq_len: int, bytes_per_token: int, device: torch.device,
                  capacity_tokens: int | None, gpu_memory_fraction: float | None, planes: int = 1) -> int:
        """How many slots fit: `capacity_tokens` positions, or `gpu_memory_fraction` of the device's memory (the
        card's, or the cap of model.device_memory_gib).

        The fraction is the KV cache's own share; weights and activations come on top of it. A
        token position holds the K/V of every plane (`bytes_per_token` counts them all), so a
        looped model of depth d fits d times fewer positions in the same memory.
        """
        if (capacity_tokens is None) == (gpu_memory_fraction is None):
            raise ValueError("size the KV cache with exactly one of capacity_tokens or gpu_memory_fraction")
        source = f"capacity_tokens={capacity_tokens}"
        if gpu_memory_fraction is not None:
            if device.type != "cuda":
                raise ValueError(f"gpu_memory_fraction sizes a CUDA cache; on {device.type} pass capacity_tokens")
            if not 0 < gpu_memory_fraction < 1:
                raise ValueError(f"gpu_memory_fraction must be in (0, 1), got {gpu_memory_fraction}")
            budget = int(device_memory_bytes(device) * gpu_memory_fraction)
            capacity_tokens = budget // bytes_per_token
            source = f"gpu_memory_fraction={gpu_memory_fraction}: {budget} bytes, {capacity_tokens} tokens"
        slots = capacity_tokens // max_seq_len
        if slots < 1:
            planes_note = f", {planes} KV planes per layer (one per loop)" if planes > 1 else ""
            raise ValueError(
                f"the KV cache ({source}) holds no sequence of max_seq_len={max_seq_len}: one sequence needs "
                f"{max_seq_len} tokens × {bytes_per_token} bytes per token = {max_seq_len * bytes_per_token} bytes"
                f"{planes_note}; raise capacity_tokens (or gpu_memory_fraction) or lower max_seq_len")
        return slots

    # ------------------------------------------------------------ memory
    def allocate(self) -> None:
        if self.kv is not None:
            return
        try:
            self.kv = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError:
            raise CacheDoesNotFit(self._does_not_fit()) from None

    def _does_not_fit(self) -> str:
        needed = self.capacity_report().bytes
        room = ""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            held = torch.cuda.memory_reserved(self.device)
            room = f": {self.device} has {free / GIB:.1f} GiB free beside the {held / GIB:.1f} GiB this process holds"
        return (f"the KV cache ({needed / GIB:.1f} GiB: {self.slots} slots of {self.max_seq_len} positions) does not "
                f"fit{room} (weights, optimizer state); lower rollout.gpu_memory_fraction, its share of the card, "
                f"or size it with rollout.capacity_tokens")

    def release(self) -> None:
        self.kv = None

    @property
    def allocated(self) -> bool:
        return self.kv is not None

    # ------------------------------------------------------------ access
    def layer(self, plane: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one (plane, layer): two `[slots, kv_heads, max_seq_len, head_dim]` views."""
        if self.kv is None:
            raise RuntimeError("the KV cache is released (engine asleep); call wake() first")
        return self.kv[plane, layer, 0], self.kv[plane, layer, 1]

    def copy_prefix(self, src: int, dst: torch.Tensor, length: int) -> None:
        """Copy positions [0, length) of slot `src` to each slot of `dst` (int64, on the cache's device), in every
        plane and layer: one kernel for all of them."""
        self.kv[:, :, :, dst, :, :length] = self.kv[:, :, :, src:src + 1, :, :length]

    def capacity_report(self) -> CapacityReport:
        planes, layers, _, slots, kv_heads, max_seq_len, head_dim = self.shape
        per_token = self.bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=self.dtype,
                                         planes=planes)
        tokens = slots * max_seq_len
        return CapacityReport(tokens=tokens, blocks=slots, block_tokens=max_seq_len, bytes=tokens * per_token,
                              bytes_per_token=per_token, planes=planes)
