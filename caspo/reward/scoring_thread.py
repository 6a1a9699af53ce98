"""Scoring while something else produces the responses: a scorer on a thread, fed one response at a time.

The engine reports each completion as it finishes (`Engine.generate(..., on_finish=)`); VinePPO's Monte
Carlo continuations are handed to a `ScoringThread` there, so that the verifier works while the engine
generates the rest instead of after it. The scorer must be callable from a thread other than the main one:
a `RewardPool` with workers is (its calls wait on pipes, which leaves the engine's thread running), inline
scoring is not (math-verify's timeouts are signals, which only the main thread receives).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

Scorer = Callable[[list[str], list[str], list[bool]], list[float]]  # (texts, labels, finished) -> rewards


class ScoringThread:
    """A scorer on a thread, fed responses as they finish: each round scores all that queued meanwhile.

    Use it as a context manager; `rewards()` waits for the last round and gives every reward in request
    order. An error of the scorer is raised again by `rewards()`; leaving the block by an error stops the
    thread after its current round. A scorer's limits per call (a `RewardPool`'s batch budget) hold per round.
    """

    _DONE = None

    def __init__(self, scorer: Scorer, count: int):
        self.scorer, self.count = scorer, count
        self._scores: list[float | None] = [None] * count
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scorer", daemon=True)

    def __enter__(self) -> "ScoringThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def put(self, i: int, text: str, label: str, finished: bool) -> None:
        self._queue.put((i, text, label, finished))

    def rewards(self) -> list[float]:
        self._stop()
        if self._error is not None:
            raise self._error
        missing = [i for i, r in enumerate(self._scores) if r is None]
        if missing:
            raise RuntimeError(f"{len(missing)} of {self.count} responses were never handed to the scorer "
                               f"(first: {missing[0]}); the engine did not report them finished")
        return self._scores

    def _stop(self) -> None:
        """Score what is queued, then end the thread (once: `rewards()` and leaving the block both call it)."""
        if self._thread.is_alive():
            self._queue.put(self._DONE)
            self._thread.join()

    def _run(self) -> None:
        done = False
        while not done:
            calls = [self._queue.get()]  # wait for one, then take whatever else is there
            while True:
                try:
                    calls.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = self._DONE in calls
            calls = [c for c in calls if c is not self._DONE]
            if not calls or self._error is not None:
                continue
            try:
                index, texts, labels, finished = zip(*calls)
                for i, reward in zip(index, self.scorer(list(texts), list(labels), list(finished))):
                    self._scores[i] = reward
            except BaseException as error:  # handed to the caller by rewards()
                self._error = error
