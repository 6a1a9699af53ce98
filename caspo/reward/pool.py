"""Score batches of responses in worker processes, with a hard wall-clock limit per call.

    with RewardPool(workers=2, timeout_s=5.0) as pool:
        result = pool.score(responses, labels, finished)   # result.rewards, result.timeouts

Each worker is a fresh interpreter (`python -c ...`) that imports only caspo.reward.verify
and math-verify. No multiprocessing start method gives that: "fork" copies the trainer
(torch threads, CUDA state), and "spawn"/"forkserver" children re-import the caller's
__main__ module, and with it torch when the training script imports torch at the top.

A worker runs one call at a time. math-verify's own SIGALRM timeouts end most slow calls
inside the worker; a call still running KILL_GRACE_S after `timeout_s` (stuck in C code,
where SIGALRM cannot interrupt it, or several slow steps in a row) gets reward 0, is counted
in `timeouts`, and its worker is killed and replaced. The other calls are unaffected.
"""

import json
import logging
import math
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Pipe, wait

from caspo.reward.verify import score

KILL_GRACE_S = 1.0  # lets math-verify's own alarm (whole seconds) fire before the pool kills
START_TIMEOUT_S = 120.0  # importing math-verify takes ~0.6 s; allow for a loaded machine

# The worker's sys.path is the parent's, as with "spawn", so the same caspo and score_fn load.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
    "from caspo.reward.verify import serve; serve(int(sys.argv[1]))"
)

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    rewards: list[float]  # in input order
    timeouts: int = 0  # calls stopped at the pool's time limit (reward 0)
    crashes: int = 0  # calls whose worker died, e.g. a segfault (reward 0)


class RewardPool:
    """A pool of reward workers; use it as a context manager.

    workers:  number of worker processes. 0 scores inline in the calling process, for
              debugging: then only math-verify's own SIGALRM timeouts apply, which work in the
              main thread only, and nothing can stop a hang in C code.
    timeout_s: time limit of one call (see the module docstring).
    score_fn: `score_fn(response, label, finished, timeout_s=...) -> float`, run in the
              workers; it must be a module-level function of an importable module (not
              __main__). Defaults to caspo.reward.verify.score; tests pass
              caspo.reward.testing.faulty_score to inject hangs and crashes.

    One batch at a time: `score` is not meant to be called from several threads at once.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, score_fn: Callable[..., float] = score):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(f"need workers >= 0 and timeout_s > 0, got {workers}, {timeout_s}")
        self.workers, self.timeout_s, self.score_fn = workers, timeout_s, score_fn
        self._workers: list[_Worker] = []

    def __enter__(self) -> "RewardPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.workers and not self._workers:
            self._workers = _start_workers(self.workers, self.score_fn, self.timeout_s)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def score(self, responses: Sequence[str], labels: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        """Rewards of a batch, in input order. Never raises on a bad or slow response."""
        if not len(responses) == len(labels) == len(finished):
            raise ValueError(f"lengths differ: {len(responses)} responses, {len(labels)} labels, "
                             f"{len(finished)} finished")
        if not all(isinstance(label, str) for label in labels):
            raise TypeError("labels must be strings")  # a worker would score them 0 one by one
        if self.workers == 0:
            calls = zip(responses, labels, finished)
            return RewardResult([float(self.score_fn(*call, timeout_s=self.timeout_s)) for call in calls])
        if not self._workers:
            raise RuntimeError("RewardPool is not started: use it as a context manager")

        result = RewardResult([0.0] * len(responses))
        todo = deque(range(len(responses)))
        idle, busy = list(self._workers), []
        while todo or busy:
            while todo and idle:
                worker, i = idle.pop(), todo.popleft()
                if worker.submit(i, (responses[i], labels[i], bool(finished[i])), self.timeout_s + KILL_GRACE_S):
                    busy.append(worker)
                else:  # it died while idle, so the call never ran: retry it on a new worker
                    todo.appendleft(i)
                    idle.append(self._replace(worker))
            ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            now = time.monotonic()
            still_busy = []
            for worker in busy:
                if worker.conn in ready:
                    reward = worker.receive()
                    if reward is not None:
                        result.rewards[worker.task] = reward
                        idle.append(worker)
                        continue
                    result.crashes += 1
                    log.warning("reward worker died on call %d (%.60r); restarting it", worker.task,
                                responses[worker.task])
                elif now >= worker.deadline:
                    result.timeouts += 1
                    log.warning("reward call %d (%.60r) timed out; restarting its worker", worker.task,
                                responses[worker.task])
                else:
                    still_busy.append(worker)
                    continue
                idle.append(self._replace(worker))
            busy = still_busy
        return result

    def _replace(self, worker: "_Worker") -> "_Worker":
        worker.kill()
        (new,) = _start_workers(1, self.score_fn, self.timeout_s)
        self._workers[self._workers.index(worker)] = new
        return new


class _Worker:
    """One worker process and the connection to it; runs one call at a time."""

    def __init__(self, score_fn: Callable[..., float], timeout_s: float):
        self.conn, child_end = Pipe()
        fd = child_end.fileno()
        cmd = [sys.executable, "-c", _BOOTSTRAP, str(fd), json.dumps(sys.path)]
        self.process = subprocess.Popen(cmd, pass_fds=(fd,))
        child_end.close()
        self.conn.send((score_fn, timeout_s))  # buffered until the worker has started
        self.task, self.deadline = -1, math.inf

    def submit(self, task: int, args: tuple, limit_s: float) -> bool:
        try:
            self.conn.send(args)
        except OSError:
            return False
        self.task, self.deadline = task, time.monotonic() + limit_s
        return True

    def receive(self) -> float | None:
        """The reward of the call in flight, or None if the worker died."""
        try:
            return float(self.conn.recv())
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.process.wait(timeout=5)
            self.conn.close()
        except (OSError, subprocess.TimeoutExpired):  # dead already, or stuck in a call
            self.kill()


def _start_workers(n: int, score_fn: Callable[..., float], timeout_s: float) -> list[_Worker]:
    """Start n workers together and wait until each has imported its score_fn."""
    workers = [_Worker(score_fn, timeout_s) for _ in range(n)]
    deadline = time.monotonic() + START_TIMEOUT_S
    for worker in workers:
        try:
            ok = worker.conn.poll(max(0.0, deadline - time.monotonic())) and worker.conn.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            for w in workers:
                w.kill()
            raise RuntimeError("a reward worker failed to start (its error, if any, is on stderr above)")
    return workers
