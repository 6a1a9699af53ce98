"""Per-phase wall-clock timers of one outer step."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start

    def reset(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return {k: round(v, 4) for k, v in times.items()}
