"""A misbehaving score function, for testing how RewardPool survives hangs and crashes."""

import os
import signal
import time

from caspo.reward.verify import Verdict, judge

HANG = "<caspo-test-hang>"
CRASH = "<caspo-test-crash>"
ALLOCATE = "<caspo-test-allocate-mb>"  # + a number: allocate that many MB, then score 1


def faulty_score(response: str, label: str, finished: bool = True, timeout_s: float | None = 5.0,
                 **options) -> Verdict | float:
    """caspo.reward.verify.judge (with its keyword options), except that response HANG hangs,
    response CRASH kills the process and response ALLOCATE + "N" allocates N MB.

    The hang blocks SIGALRM first, like a call stuck in C code that math-verify's alarm
    cannot interrupt, so only the pool's own time limit can end it.
    """
    if response == HANG:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        while True:
            time.sleep(60)
    if response == CRASH:
        os._exit(70)
    if response.startswith(ALLOCATE):
        block = bytearray(int(response[len(ALLOCATE):]) * 2**20)  # MemoryError past the worker's limit
        return float(len(block) > 0)
    return judge(response, label, finished, timeout_s, **options)
