"""Stopping a run cleanly: SIGTERM or Ctrl-C finish the current step, checkpoint it, and stop.

A launcher relays a signal to its ranks that may reach them directly too (Ctrl-C at a terminal goes to the
whole foreground process group, torchrun and `scancel` pass it on as well), so the same signal often
arrives twice within milliseconds. A repeat within REPEAT_WINDOW_S of the first is taken for that copy;
a later one interrupts at once.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

REPEAT_WINDOW_S = 5.0


class StopRequest:
    """While entered, SIGTERM and SIGINT set `requested` (the signal's name) instead of stopping."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = signal.Signals(signum).name, now
            return
        if now - self._first_at < REPEAT_WINDOW_S:  # the launcher's copy of the first
            return
        for sig, handler in self._previous.items():  # a second request: it acts at once
            signal.signal(sig, handler)
        signal.raise_signal(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def wait_relaying(proc: subprocess.Popen) -> int:
    """Wait for the launcher `proc` (torchrun) and return its exit status. SIGTERM sent to this process is
    passed on to it; SIGINT is not, since Ctrl-C at a terminal reaches it and its ranks already (otherwise
    Python's KeyboardInterrupt here would SIGKILL the launcher and its ranks mid-step)."""
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
