"""Stopping a run cleanly: SIGTERM or Ctrl-C finish the current step, checkpoint it, and stop.

A second Ctrl-C interrupts at once (the handlers are the defaults again after the first).
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """While entered, SIGTERM and SIGINT set `requested` (the signal's name) instead of stopping."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        for sig, handler in self._previous.items():  # the next one acts at once
            signal.signal(sig, handler)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
