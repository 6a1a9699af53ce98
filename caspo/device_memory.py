"""How much memory this process may take on a CUDA device, and the cap that makes a large card act as a smaller one."""

from __future__ import annotations

import torch

from caspo.config import ConfigError

GIB = 2**30


def indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index: "cuda" is the current device (the allocator's calls need the index)."""
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def limit_device_memory(device: torch.device, gib: float) -> None:
    """Cap what this process may allocate on `device` at `gib` GiB (model.device_memory_gib; 0 = no cap).

    At the cap the caching allocator frees its unused blocks and retries before it reports out of
    memory, as it would on a card of that size, so a run under a cap of 76 on a 141 GB card shows
    whether it fits an 80 GB one."""
    if gib == 0:
        return
    if device.type != "cuda":
        raise ConfigError(f"model.device_memory_gib={gib} caps a CUDA device's memory, and model.device is "
                          f"{device.type}: leave it 0")
    device = indexed(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * GIB > total:
        raise ConfigError(f"model.device_memory_gib={gib} is more than {device}'s {total / GIB:.1f} GiB: "
                          "give at most that, or 0 for the whole card")
    torch.cuda.set_per_process_memory_fraction(gib * GIB / total, device)


def device_memory_bytes(device: torch.device) -> int:
    """The memory this process may take on a CUDA `device`: the card's, or the cap `limit_device_memory` set."""
    device = indexed(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    return int(total * fraction(device)) if fraction is not None else total
