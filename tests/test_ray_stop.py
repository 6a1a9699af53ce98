"""Stopping a run launched with `--ray-address` (caspo.train.ray_launch.launch): SIGTERM and Ctrl-C let every rank
finish its step and checkpoint, a failed rank's status is the command's, and stopped ranks are waited for only so
long. Ray is played by a stand-in in the driver's process (threads for its actors, real child processes for the
ranks, its SIGTERM handler as ray.init installs it), so these run without the ray extra."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from caspo.train import ray_launch, signals

TESTS = Path(__file__).parent

# A rank's stand-in: `started`, then sleeps. On SIGTERM, by mode: "graceful" finishes its step (step_s) and its
# checkpoint and exits 0; "stuck" ignores it (blocked in a collective); "fail" dies of it, and rank 1 exits 3 at once.
RANK = """
import os, signal, sys, time
log_dir, mode, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
log = open(os.path.join(log_dir, "rank" + os.environ["RANK"] + ".log"), "a", buffering=1)
def finish_step(signum, frame):
    log.write("TERM\\n"); time.sleep(step_s); log.write("checkpoint\\n"); sys.exit(0)
if mode == "fail" and os.environ["RANK"] == "1":
    log.write("failed\\n"); sys.exit(3)
if mode == "graceful":
    signal.signal(signal.SIGTERM, finish_step)
if mode == "stuck":
    signal.signal(signal.SIGTERM, lambda signum, frame: log.write("TERM ignored\\n"))
log.write("started\\n")
time.sleep(60)
log.write("finished\\n")
"""


class FakeActor:
    """An actor: its methods run on two threads (max_concurrency=2), each call's result a future."""

    def __init__(self, cls):
        self.instance, self.pool = cls(), concurrent.futures.ThreadPoolExecutor(2)

    def __getattr__(self, name):
        method = getattr(self.instance, name)
        if name == "run":  # the rank's command, `python -m caspo.cli ARGV`, played by RANK
            def method(command, env, log=None, run=method):
                return run([command[0], "-c", RANK, *command[3:]], env, log)
        return types.SimpleNamespace(remote=lambda *args: self.pool.submit(method, *args))


class FakeRay(types.ModuleType):
    """What launch uses of Ray. shutdown() ends the ranks' processes, as Ray's does by ending its workers."""

    def __init__(self):
        super().__init__("ray")
        self.actors: list[FakeActor] = []
        self.exceptions = types.SimpleNamespace(GetTimeoutError=TimeoutError)
        self.util = types.ModuleType("ray.util")
        self.util.get_node_ip_address = lambda: "127.0.0.1"

    def init(self, **options):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does

    def remote(self, **options):
        def actor_class(cls):
            def start():
                self.actors.append(FakeActor(cls))
                return self.actors[-1]
            return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=start))
        return actor_class

    def get(self, refs, timeout=None):
        return [r.result(timeout) for r in refs] if isinstance(refs, list) else refs.result(timeout)

    def wait(self, refs, num_returns=1, timeout=None):
        done, _ = concurrent.futures.wait(refs, timeout, concurrent.futures.FIRST_COMPLETED)
        ready = [r for r in refs if r in done][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def shutdown(self):
        for actor in self.actors:
            child = actor.instance.child
            if child is not None and child.poll() is None:
                child.kill()


def install_fake_ray() -> FakeRay:
    ray = FakeRay()
    placement = types.ModuleType("ray.util.placement_group")
    ready = concurrent.futures.Future()
    ready.set_result(True)
    placement.placement_group = lambda bundles, strategy: types.SimpleNamespace(ready=lambda: ready)
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = lambda **kw: kw
    sys.modules.update({"ray": ray, "ray.util": ray.util, "ray.util.placement_group": placement,
                        "ray.util.scheduling_strategies": strategies})
    return ray


def drive(log_dir: str, mode: str, step_s: float, shutdown_s: float | None, window: float) -> None:
    """The driver's process: `caspo train --ray-address ... --nproc 2` with a fake Ray, exiting with its status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a background job ignores SIGINT)
    signals.REPEAT_WINDOW_S = window
    install_fake_ray()
    limit = {} if shutdown_s is None else {"shutdown_s": shutdown_s}
    sys.exit(ray_launch.launch("fake:6379", 2, [log_dir, mode, str(step_s)], "cpu", **limit))


def start_driver(tmp_path, mode, step_s=1.0, shutdown_s=None, window=signals.REPEAT_WINDOW_S):
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_ray_stop import drive; "
            f"drive({str(tmp_path)!r}, {mode!r}, {step_s}, {shutdown_s}, {window})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def log(tmp_path, rank) -> list[str]:
    path = tmp_path / f"rank{rank}.log"
    return path.read_text().splitlines() if path.exists() else []


def wait_until_started(driver, tmp_path) -> None:
    deadline = time.monotonic() + 60
    while not all("started" in log(tmp_path, r) for r in (0, 1)):
        assert driver.poll() is None, driver.communicate()[0]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


def finish(driver, timeout=30) -> tuple[int, str]:
    try:
        output = driver.communicate(timeout=timeout)[0]
    finally:
        driver.kill()
    return driver.returncode, output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_driver_lets_every_rank_finish_its_step_and_checkpoint(tmp_path, sig):
    driver = start_driver(tmp_path, "graceful")
    wait_until_started(driver, tmp_path)
    os.kill(driver.pid, sig)
    time.sleep(0.2)
    os.kill(driver.pid, sig)  # another copy of it (a process group's, a scheduler's): the same request
    status, output = finish(driver)
    assert status == 0, output
    assert log(tmp_path, 0) == log(tmp_path, 1) == ["started", "TERM", "checkpoint"]  # stopped once, then waited for
    assert f"{signal.Signals(sig).name}: asking the 2 ranks to stop after their step" in output


def test_a_second_signal_after_the_window_ends_the_ranks_at_once(tmp_path):
    driver = start_driver(tmp_path, "graceful", step_s=20, window=0.5)
    wait_until_started(driver, tmp_path)
    os.kill(driver.pid, signal.SIGTERM)
    time.sleep(1.5)
    began = time.monotonic()
    os.kill(driver.pid, signal.SIGTERM)
    status, output = finish(driver)
    assert time.monotonic() - began < 10, output  # not the ranks' 20 s step
    assert status == signal.SIGTERM  # Ray's handler: sys.exit(15)
    assert log(tmp_path, 0) == ["started", "TERM"]


def test_the_command_exits_with_the_failed_ranks_status_not_that_of_a_peer_stopped_after_it(tmp_path):
    driver = start_driver(tmp_path, "fail")
    status, output = finish(driver)
    assert status == 3, output  # rank 0, ended by the stop, exits 128 + SIGTERM
    assert log(tmp_path, 1) == ["failed"]
    assert "rank 1 exited with status 3; stopping the others" in output


def test_ranks_that_do_not_stop_are_waited_for_only_the_shutdown_time(tmp_path):
    driver = start_driver(tmp_path, "stuck", shutdown_s=1.0)
    wait_until_started(driver, tmp_path)
    began = time.monotonic()
    os.kill(driver.pid, signal.SIGTERM)
    status, output = finish(driver)
    assert time.monotonic() - began < 10, output
    assert status == ray_launch.KILLED
    assert "did not end within 1 s of their stop" in output
    assert log(tmp_path, 0) == ["started", "TERM ignored"]


def test_exit_status_of_a_rank_killed_by_a_signal_is_the_shells():
    assert [ray_launch.exit_status(c) for c in (0, 3, -signal.SIGTERM)] == [0, 3, 128 + signal.SIGTERM]
