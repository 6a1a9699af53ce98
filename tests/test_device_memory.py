"""model.device_memory_gib: a cap on what the process may allocate on its CUDA device, of which the native
engine's KV share is a fraction. The CUDA calls are scripted on the CPU; the GPU test caps a real card
in a process of its own (the cap is process-wide)."""

import subprocess
import sys

import pytest
import torch

from caspo.config import ConfigError, load_config
from caspo.device_memory import GIB, device_memory_bytes, limit_device_memory
from caspo.rollout.native.kv_cache import KVCache

CUDA = torch.device("cuda", 0)


class Card:
    """A card of `total` bytes and the process's memory fraction, as torch.cuda reports them."""

    def __init__(self, monkeypatch, total_gib: float):
        self.total, self.fraction, self.calls = int(total_gib * GIB), 1.0, []
        props = type("Props", (), {"total_memory": self.total})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", self.get_fraction, raising=False)

    def set_fraction(self, fraction, device):
        assert device.index is not None  # as torch.cuda insists
        self.fraction = fraction
        self.calls.append((fraction, device))

    def get_fraction(self, device):
        assert device.index is not None
        return self.fraction


def test_the_cap_is_a_fraction_of_the_card(monkeypatch):
    card = Card(monkeypatch, total_gib=140.0)
    limit_device_memory(CUDA, 76.0)
    assert card.calls == [(76.0 / 140.0, CUDA)]
    assert device_memory_bytes(CUDA) == int(card.total * 76.0 / 140.0)


def test_a_device_without_index_is_capped_as_the_current_one(monkeypatch):
    card = Card(monkeypatch, total_gib=140.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    limit_device_memory(torch.device("cuda"), 70.0)
    assert card.calls == [(0.5, torch.device("cuda", 3))]
    assert device_memory_bytes(torch.device("cuda")) == card.total // 2


def test_no_cap_leaves_the_card_whole(monkeypatch):
    card = Card(monkeypatch, total_gib=140.0)
    limit_device_memory(CUDA, 0.0)
    assert card.calls == [] and device_memory_bytes(CUDA) == card.total


def test_a_cap_above_the_card_or_off_cuda_is_refused(monkeypatch):
    Card(monkeypatch, total_gib=80.0)
    with pytest.raises(ConfigError, match="more than cuda:0's 80.0 GiB"):
        limit_device_memory(CUDA, 96.0)
    with pytest.raises(ConfigError, match="model.device is cpu: leave it 0"):
        limit_device_memory(torch.device("cpu"), 8.0)


def test_the_kv_share_is_of_the_cap(monkeypatch):
    """gpu_memory_fraction 0.3 under a 76 GiB cap on a 140 GiB card sizes the cache from 22.8 GiB, not 42:
    a slot of 3,072 positions × 28 KiB is 84 MiB, so 42 GiB hold 512 slots and 22.8 GiB 277."""
    Card(monkeypatch, total_gib=140.0)
    per_token, seq = 28 * 2 * 2 * 128 * 2, 3072  # Qwen2.5-1.5B in bf16: 28 KiB per position
    whole = KVCache.slots_for(max_seq_len=seq, bytes_per_token=per_token, device=CUDA, capacity_tokens=None,
                              gpu_memory_fraction=0.3)
    limit_device_memory(CUDA, 76.0)
    capped = KVCache.slots_for(max_seq_len=seq, bytes_per_token=per_token, device=CUDA, capacity_tokens=None,
                               gpu_memory_fraction=0.3)
    assert whole == int(140 * GIB * 0.3) // per_token // seq == 512
    assert capped == int(int(140 * GIB * 76 / 140) * 0.3) // per_token // seq == 277


def test_the_config_takes_a_positive_cap_or_zero():
    assert load_config("tests", ["model.device_memory_gib=76"]).model.device_memory_gib == 76.0
    with pytest.raises(ConfigError, match="model.device_memory_gib must be > 0"):
        load_config("tests", ["model.device_memory_gib=-1"])


CAPPED = """
import torch
from caspo.device_memory import GIB, device_memory_bytes, limit_device_memory
device = torch.device("cuda", 0)
limit_device_memory(device, 2.0)
assert abs(device_memory_bytes(device) - 2 * GIB) < 2**20, device_memory_bytes(device)
kept = torch.empty(GIB, dtype=torch.uint8, device=device)
try:
    torch.empty(2 * GIB, dtype=torch.uint8, device=device)
except torch.OutOfMemoryError:
    print("refused")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_capped_process_cannot_allocate_past_its_cap():
    """1 GiB fits under a 2 GiB cap; 2 GiB more does not, on a card with far more free."""
    out = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "refused"
