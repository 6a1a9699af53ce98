"""PhaseTimer's per-phase memory on CUDA, with the CUDA memory counters scripted: each phase resets the peak
counter, records its own peak and what it left reserved, and the step's peak is the largest phase's."""

import pytest
import torch

from caspo.device_memory import GIB
from caspo.train import health
from caspo.train.timers import PhaseTimer

clock = [0.0]  # perf_counter, scripted


class ScriptedCuda:
    """The allocator counters as one phase after another would move them."""

    def __init__(self):
        self.peak, self.reserved, self.allocated, self.resets, self.retries = 0, 0, 0, 0, 0
        self.peak_reserved = 0
        self.queued_s = 0.0  # GPU work queued but not yet run

    def use(self, peak_gb, reserved_gb, allocated_gb=1.0, peak_reserved_gb=0.0):
        self.peak = max(self.peak, int(peak_gb * GIB))
        self.reserved, self.allocated = int(reserved_gb * GIB), int(allocated_gb * GIB)
        self.peak_reserved = max(self.peak_reserved, self.reserved, int(peak_reserved_gb * GIB))

    def synchronize(self, device):  # the card finishes what was queued: the clock moves on by that much
        clock[0] += self.queued_s
        self.queued_s = 0.0

    def reset_peak_memory_stats(self, device):
        self.peak, self.peak_reserved, self.resets = self.allocated, self.reserved, self.resets + 1


@pytest.fixture
def cuda(monkeypatch):
    fake = ScriptedCuda()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: fake.peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: fake.reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: fake.peak_reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: fake.allocated)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": fake.retries})
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_each_phase_keeps_its_own_peak_and_the_step_the_largest(cuda):
    timer = PhaseTimer(torch.device("cuda", 0))
    with timer("t_step"):
        with timer("t_roll"):
            cuda.use(peak_gb=60.0, reserved_gb=70.0)
        with timer("t_pol"):  # reserved rises to 80 inside the phase, and the cache is emptied to 50
            cuda.use(peak_gb=45.0, reserved_gb=50.0, peak_reserved_gb=80.0)
        with timer("t_pol"):  # a phase timed twice keeps its larger peak
            cuda.use(peak_gb=20.0, reserved_gb=30.0)
    assert cuda.resets == 3  # once per inner phase, never for the step itself
    assert timer.step_peak_gb() == 60.0
    out = timer.reset()
    assert (out["mem_roll_peak_gb"], out["mem_roll_reserved_gb"]) == (60.0, 70.0)
    assert (out["mem_pol_peak_gb"], out["mem_pol_reserved_gb"]) == (45.0, 30.0)
    assert (out["mem_roll_peak_reserved_gb"], out["mem_pol_peak_reserved_gb"]) == (70.0, 80.0)
    assert "mem_step_peak_gb" not in out and {"t_step", "t_roll", "t_pol"} <= set(out)
    # the step's row: the largest phase's peak, not the counter since the last phase's reset
    stats = health.memory_stats(torch.device("cuda", 0), out)
    assert stats["mem_peak_gb"] == 60.0 and stats["mem_reserved_gb"] == 30.0
    assert stats["mem_peak_reserved_gb"] == 80.0  # t_pol's, not what the last phase left


def test_on_the_cpu_only_times():
    timer = PhaseTimer(torch.device("cpu"))
    with timer("t_roll"):
        pass
    assert list(timer.reset()) == ["t_roll"]
    assert health.memory_stats(torch.device("cpu"), {}) == {}


def test_the_step_counts_its_allocator_retries(cuda):
    timer = PhaseTimer(torch.device("cuda", 0))
    cuda.retries = 5  # earlier steps' retries are not this step's
    with timer("t_step"):
        with timer("t_pol"):
            cuda.retries += 2
    assert timer.reset()["mem_alloc_retries"] == 2


def test_the_step_counts_the_graphs_compiled_in_it():
    """A new input shape makes torch.compile build a graph; the same shape again builds none."""
    compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    timer = PhaseTimer(torch.device("cpu"))
    with timer("t_step"):
        compiled(torch.ones(3))
    assert timer.reset()["compiled_graphs"] == 1
    with timer("t_step"):
        compiled(torch.ones(3))
    assert timer.reset()["compiled_graphs"] == 0


def test_a_phase_is_charged_the_gpu_work_it_queued(cuda, monkeypatch):
    """Kernels launched in t_roll that the card runs after the launching returns count in t_roll, not in
    the phase that first waits on them."""
    from caspo.train import timers
    monkeypatch.setattr(timers.time, "perf_counter", lambda: clock[0])
    timer = PhaseTimer(torch.device("cuda", 0))
    with timer("t_roll"):
        clock[0] += 0.5  # launching
        cuda.queued_s = 3.0  # what the card still has to run
    with timer("t_pol"):
        clock[0] += 1.0
    out = timer.reset()
    assert (out["t_roll"], out["t_pol"]) == (3.5, 1.0)
