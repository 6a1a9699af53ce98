"""Score batches of responses in worker processes, bounded in time and memory.

    with RewardPool.from_config(cfg.reward) as pool:
        result = pool.score(responses, labels, finished)   # result.rewards, result.timeouts, ...

Each worker is a fresh interpreter (`python -c ...`) that imports only caspo.reward and
math-verify. No multiprocessing start method gives that: "fork" copies the trainer (torch
threads, CUDA state), and "spawn"/"forkserver" children re-import the caller's __main__
module, and with it torch when the training script imports torch at the top.

The limits (docs/reliability.md, "Verifier"):

- time per call: math-verify's own SIGALRM timeouts end most slow calls inside the worker (reward 0,
  counted in `verifier_timeouts`); a call still running KILL_GRACE_S after `timeout_s` (stuck in C
  code, where SIGALRM cannot interrupt it, or several slow steps in a row) gets reward 0, is counted
  in `timeouts`, and its worker is killed and replaced. The other calls are unaffected.
- time per batch: calls not finished `batch_budget_s` after the batch began get reward 0 and are
  counted in `over_budget`; the workers still busy are killed and replaced. The clock starts once
  the replacements left by the previous batch are ready, so a restart is never charged to a batch.
- memory: each worker's address space is limited to `memory_mb` (RLIMIT_AS), so an allocation
  past it fails inside the call (reward 0) instead of swapping the machine; a worker is replaced
  after `recycle_after` calls, or when its resident set grows past `recycle_rss_mb` (caches keep
  what big answers left behind).

Replacements start in the background: the batch goes on with the other workers meanwhile.
"""

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from multiprocessing.connection import wait

from caspo.reward.extract import EXTRACTORS, FALLBACKS
from caspo.reward.verify import judge
from caspo.reward.worker import KILL_GRACE_S, Worker, verdict_of

DEFAULT_WORKER_MEMORY_MB = 2048  # used where the platform can limit it (memory_mb=None)
DEFAULT_RECYCLE_AFTER = 1000
DEFAULT_RECYCLE_RSS_MB = 512  # a fresh worker holds ~100 MB
DEFAULT_BATCH_BUDGET_S = 300.0

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    rewards: list[float]  # in input order
    timeouts: int = 0  # calls stopped at the pool's time limit (reward 0)
    verifier_timeouts: int = 0  # calls that math-verify's own alarm ended inside the worker (reward 0)
    crashes: int = 0  # calls whose worker died, e.g. a segfault (reward 0)
    over_budget: int = 0  # calls not finished when the batch's time budget ran out (reward 0)
    recycled: int = 0  # workers replaced after recycle_after calls or above recycle_rss_mb
    max_call_s: float = 0.0  # the longest call, from its submission to its reward (or its worker's kill)
    max_rss_mb: float = 0.0  # the largest peak resident set a worker reported


@dataclass
class Unscored:
    """Calls that scored 0 for want of a verdict, by cause (RewardResult's counters of them), summed over the
    batches `add` is given: answers an evaluation or a Monte Carlo estimate counts as wrong without a check."""

    timeouts: int = 0
    verifier_timeouts: int = 0
    crashes: int = 0
    over_budget: int = 0

    def add(self, result: "RewardResult | Unscored") -> "Unscored":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(result, f.name))
        return self

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def counts(self, prefix: str = "") -> dict[str, int]:
        """Each cause and the total ("unscored"), their keys prefixed (`mc_reward_` gives mc_reward_timeouts, ...)."""
        return {f"{prefix}{key}": n for key, n in (asdict(self) | {"unscored": self.total}).items()}


class TallyingScorer:
    """`pool.score` for callers that take only the rewards (a caspo.reward.scoring_thread.Scorer, as Monte Carlo
    continuations are scored), with the calls left without a verdict summed in `unscored`."""

    def __init__(self, pool):
        self.pool, self.unscored = pool, Unscored()

    def __call__(self, texts: list[str], labels: list[str], finished: list[bool]) -> list[float]:
        result = self.pool.score(texts, labels, finished)
        self.unscored.add(result)
        return result.rewards


class RewardPool:
    """A pool of reward workers; use it as a context manager.

    workers:  number of worker processes. 0 scores inline in the calling process, for
              debugging: then only math-verify's own SIGALRM timeouts (main thread only) and the
              batch budget apply, with no memory limit, and nothing can stop a hang in C code.
    timeout_s: time limit of one call (see the module docstring).
    score_fn: `score_fn(response, label, finished, timeout_s=...)`, run in the workers, returning
              the reward or a (reward, timed_out) pair (caspo.reward.verify.Verdict; timed_out counts
              in `verifier_timeouts`); a module-level function of an importable module (not __main__),
              or a functools.partial of one. Defaults to caspo.reward.verify.judge; `from_config` binds
              its options; tests pass caspo.reward.testing.faulty_score to inject hangs and crashes.
    memory_mb: each worker's address-space limit; None = DEFAULT_WORKER_MEMORY_MB where the
              platform can limit it (a warning where it cannot), 0 = no limit, > 0 = that limit
              (an error where the platform cannot).
    recycle_after, recycle_rss_mb: replace a worker after that many calls / above that resident
              set size (0 = never).
    batch_budget_s: time budget of one `score` call (0 = none).

    One batch at a time: `score` is not meant to be called from several threads at once.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, score_fn: Callable = judge, *,
                 memory_mb: int | None = None, recycle_after: int = DEFAULT_RECYCLE_AFTER,
                 recycle_rss_mb: float = DEFAULT_RECYCLE_RSS_MB, batch_budget_s: float = DEFAULT_BATCH_BUDGET_S):
        if workers < 0 or timeout_s <= 0:
            raise ValueError(f"need workers >= 0 and timeout_s > 0, got {workers}, {timeout_s}")
        if (memory_mb is not None and memory_mb < 0) or recycle_after < 0 or recycle_rss_mb < 0 or batch_budget_s < 0:
            raise ValueError(f"need memory_mb, recycle_after, recycle_rss_mb and batch_budget_s >= 0 (0 = off), got "
                             f"{memory_mb}, {recycle_after}, {recycle_rss_mb}, {batch_budget_s}")
        self.workers, self.timeout_s, self.score_fn = workers, timeout_s, score_fn
        self.memory_mb = DEFAULT_WORKER_MEMORY_MB if memory_mb is None else memory_mb
        self.memory_required = memory_mb is not None
        self.recycle_after, self.recycle_rss_mb, self.batch_budget_s = recycle_after, recycle_rss_mb, batch_budget_s
        self._workers: list[Worker] = []
        self._retired: list[Worker] = []
        self._warned = False

    @classmethod
    def from_config(cls, cfg, score_fn: Callable = judge) -> "RewardPool":
        """The pool a `reward:` config section (caspo.config.RewardConfig) describes."""
        if cfg.extractor not in EXTRACTORS or cfg.fallback not in FALLBACKS:
            raise ValueError(f"reward.extractor must be one of {EXTRACTORS} and reward.fallback one of "
                             f"{FALLBACKS}; got {cfg.extractor!r}, {cfg.fallback!r}")
        bound = partial(score_fn, extractor=cfg.extractor, fallback=cfg.fallback,
                        max_answer_chars=cfg.max_answer_chars)
        return cls(cfg.workers, cfg.timeout_s, bound, memory_mb=cfg.worker_memory_mb,
                   recycle_after=cfg.recycle_after, recycle_rss_mb=cfg.recycle_rss_mb,
                   batch_budget_s=cfg.batch_budget_s)

    def __enter__(self) -> "RewardPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers and wait until each is ready."""
        if self.workers and not self._workers:
            self._workers = [self._new_worker() for _ in range(self.workers)]
            try:
                for worker in self._workers:
                    self._ready(worker, worker.wait_ready())
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        for worker in self._workers + self._retired:
            worker.stop()
        self._workers, self._retired = [], []

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def score(self, responses: Sequence[str], labels: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        """Rewards of a batch, in input order. Never raises on a bad or slow response."""
        if not len(responses) == len(labels) == len(finished):
            raise ValueError(f"lengths differ: {len(responses)} responses, {len(labels)} labels, "
                             f"{len(finished)} finished")
        if not all(isinstance(label, str) for label in labels):
            raise TypeError("labels must be strings")  # a worker would score them 0 one by one
        for worker in self._workers:
            if worker.starting:
                self._ready(worker, worker.wait_ready())
        deadline = time.monotonic() + self.batch_budget_s if self.batch_budget_s else math.inf
        if self.workers == 0:
            return self._score_inline(responses, labels, finished, deadline)
        if not self._workers:
            raise RuntimeError("RewardPool is not started: use it as a context manager")

        result = RewardResult([0.0] * len(responses))
        todo = deque(range(len(responses)))
        while True:
            for worker in self._workers:
                if todo and worker.idle:
                    i = todo.popleft()
                    if not worker.submit(i, (responses[i], labels[i], bool(finished[i])),
                                         self.timeout_s + KILL_GRACE_S):
                        todo.appendleft(i)  # it died while idle, so the call never ran: retry it on a new worker
                        self._replace(worker)
            busy = [w for w in self._workers if w.busy]
            if not todo and not busy:
                break
            if time.monotonic() >= deadline:
                self._out_of_budget(result, todo, busy)
                break
            waiting = [w for w in self._workers if w.busy or w.starting]
            until = min(min(w.deadline for w in waiting), deadline)
            ready = set(wait([w.conn for w in waiting], timeout=max(0.0, until - time.monotonic())))
            for worker in waiting:
                self._collect(worker, worker.conn in ready, result, responses)
        return result

    def _collect(self, worker: Worker, readable: bool, result: RewardResult, responses: Sequence[str]) -> None:
        now = time.monotonic()
        if worker.starting:
            if readable:
                self._ready(worker, worker.finish_start())
            elif now >= worker.deadline:
                raise RuntimeError("a reward worker did not start in time (its error, if any, is on stderr above)")
            return
        if not readable and now < worker.deadline:
            return
        task, elapsed = worker.task, now - worker.submitted
        result.max_call_s = max(result.max_call_s, elapsed)
        reply = worker.receive() if readable else None
        if reply is not None:
            reward, timed_out, rss, peak = reply
            result.rewards[task] = reward
            result.verifier_timeouts += timed_out
            result.max_rss_mb = max(result.max_rss_mb, peak / 2**20)
            if (self.recycle_after and worker.calls >= self.recycle_after) or \
                    (self.recycle_rss_mb and rss / 2**20 > self.recycle_rss_mb):
                result.recycled += 1
                self._retire(worker)
            return
        if readable:
            result.crashes += 1
            log.warning("reward worker died on call %d (%.60r); restarting it", task, responses[task])
        else:
            result.timeouts += 1
            log.warning("reward call %d (%.60r) timed out; restarting its worker", task, responses[task])
        self._replace(worker)

    def _out_of_budget(self, result: RewardResult, todo: deque, busy: list[Worker]) -> None:
        result.over_budget = len(todo) + len(busy)
        now = time.monotonic()
        for worker in busy:
            result.max_call_s = max(result.max_call_s, now - worker.submitted)
            self._replace(worker)
        log.warning("reward batch ran past reward.batch_budget_s=%s: %d of %d calls unfinished score 0",
                    self.batch_budget_s, result.over_budget, len(result.rewards))

    def _score_inline(self, responses, labels, finished, deadline: float) -> RewardResult:
        result = RewardResult([0.0] * len(responses))
        for i, call in enumerate(zip(responses, labels, finished)):
            if time.monotonic() >= deadline:
                result.over_budget = len(responses) - i
                break
            start = time.monotonic()
            result.rewards[i], timed_out = verdict_of(self.score_fn(*call, timeout_s=self.timeout_s))
            result.verifier_timeouts += timed_out
            result.max_call_s = max(result.max_call_s, time.monotonic() - start)
        return result

    def _new_worker(self) -> Worker:
        return Worker(self.score_fn, self.timeout_s, self.memory_mb * 2**20 if self.memory_mb else None,
                      self.memory_required)

    def _ready(self, worker: Worker, limited: bool) -> None:
        if self.memory_mb and not limited and not self._warned:
            self._warned = True
            log.warning("reward workers run without a memory limit: this platform cannot limit a process's "
                        "address space (set reward.worker_memory_mb=0 to silence this)")

    def _replace(self, worker: Worker) -> None:
        """Kill `worker` and start its replacement in its slot (in the background)."""
        worker.kill()
        self._workers[self._workers.index(worker)] = self._new_worker()

    def _retire(self, worker: Worker) -> None:
        """Let an idle `worker` exit on its own and start its replacement (in the background)."""
        worker.retire()
        self._retired = [w for w in self._retired if not w.reaped()] + [worker]
        self._workers[self._workers.index(worker)] = self._new_worker()
