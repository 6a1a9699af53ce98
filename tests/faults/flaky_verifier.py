"""A score function for reward workers that hangs once and kills its worker once in a whole run.

A worker's third call (after its warm-up call and one real call, so the fault comes mid-batch) takes a
fault that no earlier worker took: first a hang that math-verify's alarm cannot end
(caspo.reward.testing.HANG), then a crash (CRASH). `marks` is a folder where each fault, once taken, is a
file holding the pid of the worker that took it. Every other call is the real verifier.
"""

import os
from pathlib import Path

from caspo.reward.testing import CRASH, HANG, faulty_score

FAULTS = {"hang": HANG, "crash": CRASH}
calls = 0  # in this worker process


def flaky_score(response: str, label: str, finished: bool = True, timeout_s: float | None = 5.0, *, marks: str,
                **options) -> float:
    global calls
    calls += 1
    if calls == 3:
        for name, fault in FAULTS.items():
            try:  # O_EXCL: exactly one worker takes each fault, even with several racing
                fd = os.open(Path(marks) / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return faulty_score(fault, label, finished, timeout_s)
    return faulty_score(response, label, finished, timeout_s, **options)
