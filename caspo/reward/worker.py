"""A reward worker: the process (`serve`, its memory limit, what it reports) and the pool's handle
on it (`Worker`).

caspo.reward.pool starts each worker as `python -c ...` calling `serve(fd)`. This module imports
only the standard library, so a worker loads nothing but its score_fn's module (caspo.reward.verify
and math-verify by default).
"""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Pipe

KILL_GRACE_S = 1.0  # lets math-verify's own alarm (whole seconds) fire before the pool kills
START_TIMEOUT_S = 120.0  # importing math-verify takes ~0.6 s; allow for a loaded machine
STOP_TIMEOUT_S = 5.0

# The worker's sys.path is the parent's, as with "spawn", so the same caspo and score_fn load.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
    "from caspo.reward.worker import serve; serve(int(sys.argv[1]))"
)


def serve(fd: int) -> None:
    """Entry point of a reward worker process (see caspo.reward.pool).

    Talks over the multiprocessing Connection on file descriptor `fd`. Receives once
    (score_fn, timeout_s, memory_bytes, memory_required); scores one fraction, so that what
    scoring imports is loaded; limits its address space to memory_bytes
    (None: no limit) and answers ("ready", limited) or ("error", message) when a required limit
    cannot be set. Then answers each (response, label, finished) task with
    (reward, timed_out, rss_bytes, peak_rss_bytes), until it receives None or the other end closes.
    """
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which stops us
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeout warnings print whole responses
    warnings.simplefilter("ignore")  # sympy's deprecation warnings about odd model answers help nobody
    conn = Connection(fd)
    score_fn, timeout_s, memory_bytes, memory_required = conn.recv()
    try:  # load what scoring loads (sympy, the LaTeX parser) before measuring and limiting memory
        score_fn("\\boxed{\\frac{1}{2}}", "0.5", True, timeout_s=timeout_s)
    except Exception:
        pass
    limited, problem = limit_memory(memory_bytes)
    if problem and memory_required:
        conn.send(("error", problem))
        return
    conn.send(("ready", limited))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # parent went away
            return
        if task is None:
            return
        try:
            reward, timed_out = verdict_of(score_fn(*task, timeout_s=timeout_s))
        except MemoryError:
            logging.getLogger(__name__).warning("a reward call reached the worker's memory limit "
                                                "(reward.worker_memory_mb); reward 0")
            reward, timed_out = 0.0, False
        except Exception:
            logging.getLogger(__name__).exception("score_fn raised; reward 0")
            reward, timed_out = 0.0, False
        conn.send((reward, timed_out, rss_bytes(), peak_rss_bytes()))


def verdict_of(returned) -> tuple[float, bool]:
    """(reward, timed out) of what a score_fn returned: a reward, or a (reward, timed_out) pair such as
    caspo.reward.verify.Verdict, whose timed_out says that the verifier's own alarm ended the call."""
    if isinstance(returned, tuple):
        reward, timed_out = returned
        return float(reward), bool(timed_out)
    return float(returned), False


def limit_memory(memory_bytes: int | None) -> tuple[bool, str | None]:
    """Limit this process's address space (RLIMIT_AS) to memory_bytes: (limited, problem or None)."""
    if not memory_bytes:
        return False, None
    mb = memory_bytes // 2**20
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY and hard < memory_bytes:
            memory_bytes = hard
        in_use = address_space_bytes()
        if in_use is not None and in_use >= memory_bytes:
            return False, (f"reward.worker_memory_mb={mb} is below the {in_use // 2**20} MB a reward worker "
                           "uses after importing its verifier; raise it (or 0 for no limit)")
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    except (ImportError, AttributeError, ValueError, OSError) as e:
        return False, (f"reward.worker_memory_mb={mb}: this platform ({sys.platform}) cannot limit a "
                       f"process's address space ({e}); set reward.worker_memory_mb=0 for no limit")
    return True, None


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image (Linux VmHWM), else getrusage's peak.

    getrusage's ru_maxrss survives exec, so there it includes the parent's memory at the fork.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def address_space_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Worker:
    """The pool's handle on one worker process: starting, then idle or busy with one call."""

    def __init__(self, score_fn: Callable[..., float], timeout_s: float, memory_bytes: int | None,
                 memory_required: bool):
        self.conn, child_end = Pipe()
        fd = child_end.fileno()
        cmd = [sys.executable, "-c", _BOOTSTRAP, str(fd), json.dumps(sys.path)]
        self.process = subprocess.Popen(cmd, pass_fds=(fd,))
        child_end.close()
        self.conn.send((score_fn, timeout_s, memory_bytes, memory_required))  # buffered until it has started
        self.starting, self.busy = True, False
        self.task, self.calls = -1, 0
        self.submitted, self.deadline = time.monotonic(), time.monotonic() + START_TIMEOUT_S

    @property
    def idle(self) -> bool:
        return not self.starting and not self.busy

    def wait_ready(self) -> bool:
        """Block until the worker has started; whether its memory limit is in force."""
        if not self.conn.poll(max(0.0, self.deadline - time.monotonic())):
            raise RuntimeError("a reward worker did not start in time (its error, if any, is on stderr above)")
        return self.finish_start()

    def finish_start(self) -> bool:
        """Read the worker's first message: whether its memory limit is in force; raises if it failed."""
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError, ValueError, TypeError):
            raise RuntimeError("a reward worker failed to start (its error, if any, is on stderr above)") from None
        if kind != "ready":
            raise RuntimeError(detail)
        self.starting, self.deadline = False, math.inf
        return detail

    def submit(self, task: int, args: tuple, limit_s: float) -> bool:
        try:
            self.conn.send(args)
        except OSError:
            return False
        self.busy, self.task = True, task
        self.submitted = time.monotonic()
        self.deadline = self.submitted + limit_s
        return True

    def receive(self) -> tuple[float, bool, int, int] | None:
        """(reward, timed out, rss bytes, peak rss bytes) of the call in flight, or None if the worker died."""
        try:
            reward, timed_out, rss, peak = self.conn.recv()
        except (EOFError, OSError, ValueError, TypeError):
            return None
        self.busy, self.deadline = False, math.inf
        self.calls += 1
        return float(reward), bool(timed_out), rss, peak

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()

    def retire(self) -> None:
        """Ask an idle worker to exit; it is reaped later (`reaped`, `stop`)."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()

    def reaped(self) -> bool:
        return self.process.poll() is not None

    def stop(self) -> None:
        try:
            if not self.conn.closed:
                self.conn.send(None)
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):  # dead already, or stuck in a call
            self.process.kill()
            self.process.wait()
        if not self.conn.closed:
            self.conn.close()
