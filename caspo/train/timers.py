"""Per-phase wall-clock timers of one outer step, and on CUDA each phase's memory."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from caspo.device_memory import GIB

OUTER = "t_step"  # holds the other phases: its memory is the step's (health.memory_stats)


class PhaseTimer:
    """`with timer("t_roll"): ...` adds the phase's seconds to `t_roll`. With a CUDA `device`, a phase also
    records the peak memory allocated inside it, the peak the caching allocator reserved (what the card
    must hold) and the memory reserved at its end (`mem_roll_peak_gb`, `mem_roll_peak_reserved_gb`,
    `mem_roll_reserved_gb`): the peak counters are reset when a phase starts, so the step's own peaks are
    the largest of its phases' (`step_peak_gb`).

    The outer phase (t_step) also counts what makes a step slow without showing in its phases:
    `compiled_graphs`, the graphs torch.compile built during it (where train.compile met new shapes;
    counted once torch._dynamo is loaded), and on CUDA `mem_alloc_retries`, the allocations that had to
    free the allocator's cache and retry. Under `torch.profiler` each phase is a range named by its key.

    On CUDA a phase waits for the card at its start and end, so that kernels queued by one phase are not
    charged to the next (the phases are seconds long; the waits cost microseconds)."""

    def __init__(self, device: torch.device | None = None):
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.cuda = device if device is not None and device.type == "cuda" else None

    @contextmanager
    def __call__(self, phase: str):
        track = self.cuda is not None and phase != OUTER
        if track:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        before = self._counters() if phase == OUTER else None
        self._wait_for_card()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(phase):  # a named range when a profiler records the step
                yield
        finally:
            self._wait_for_card()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start
            if before is not None:
                for key, value in self._counters().items():
                    self.memory[key] = self.memory.get(key, 0) + value - before.get(key, 0)
            if track:
                name = phase.removeprefix("t_")
                peak = round(torch.cuda.max_memory_allocated(self.cuda) / GIB, 3)
                key = f"mem_{name}_peak_gb"
                self.memory[key] = max(self.memory.get(key, 0.0), peak)
                key = f"mem_{name}_peak_reserved_gb"
                peak = round(torch.cuda.max_memory_reserved(self.cuda) / GIB, 3)
                self.memory[key] = max(self.memory.get(key, 0.0), peak)
                self.memory[f"mem_{name}_reserved_gb"] = round(torch.cuda.memory_reserved(self.cuda) / GIB, 3)

    def _wait_for_card(self) -> None:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)

    def _counters(self) -> dict[str, int]:
        counts = {}
        dynamo = sys.modules.get("torch._dynamo")  # not imported here: a run without compilation never loads it
        if dynamo is not None:
            counts["compiled_graphs"] = int(dynamo.utils.counters["stats"]["unique_graphs"])
        if self.cuda is not None:
            counts["mem_alloc_retries"] = int(torch.cuda.memory_stats(self.cuda).get("num_alloc_retries", 0))
        return counts

    def step_peak_gb(self) -> float:
        return max((v for k, v in self.memory.items() if k.endswith("_peak_gb")), default=0.0)

    def reset(self) -> dict[str, float]:
        times, memory, self.times, self.memory = self.times, self.memory, {}, {}
        return {**{k: round(v, 4) for k, v in times.items()}, **memory}
