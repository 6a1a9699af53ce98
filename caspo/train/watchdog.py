"""The watchdog of a run: a thread that notices when no outer step has finished for train.health.watchdog_s
seconds, warns on the console and marks <run>/status.json "stalled" (back to "running" at the next step).
It only watches: a stalled run is left to its operator (a hung verifier or a collective shows up here)."""

from __future__ import annotations

import threading
import time

from caspo.runlog import StatusFile, console, now


class Watchdog:
    def __init__(self, status: StatusFile, timeout_s: float, poll_s: float | None = None):
        self.status, self.timeout_s = status, timeout_s
        self.poll_s = poll_s if poll_s is not None else min(max(timeout_s / 10, 0.05), 30.0)
        self.last, self.last_step, self.stalled = time.monotonic(), None, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="caspo-watchdog", daemon=True)

    def beat(self, step: int) -> None:
        """An outer step finished (the main thread calls this)."""
        self.last, self.last_step = time.monotonic(), step
        fields = {"state": "running", "step": step, "last_step_at": now()}
        if self.stalled:
            self.stalled = False
            fields["message"] = ""
            console.print(f"[green]watchdog: step {step} finished; the run goes on[/green]")
        self.status.update(**fields)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s and not self.stalled:
                self.stalled = True
                since = f"step {self.last_step} finished" if self.last_step is not None else "the run started"
                message = (f"no outer step for {idle:.0f} s (train.health.watchdog_s={self.timeout_s:g}) since "
                           f"{since}: "
                           "the run may be stalled (a hung verifier, engine or device; py-spy dump "
                           f"--pid {self.status.status['pid']} shows where it waits)")
                console.print(f"[yellow]watchdog: {message}[/yellow]")
                self.status.update(state="stalled", message=message)

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
