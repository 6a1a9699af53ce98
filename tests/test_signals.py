"""Stop signals: the launcher's copy of a signal does not interrupt a step; the parent of torchrun passes
SIGTERM on and leaves SIGINT to the terminal's process group."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from caspo.train import signals
from caspo.train.signals import StopRequest, wait_relaying


def test_a_repeat_within_the_window_is_the_first_signal_and_a_later_one_interrupts(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's relay of the same Ctrl-C, milliseconds later
        assert stop.requested == "SIGINT"
        clock[0] += signals.REPEAT_WINDOW_S + 1
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C, seconds later: at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_launchers_parent_passes_sigterm_on_and_ignores_sigint(tmp_path):
    log = tmp_path / "child.log"
    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"log = open({str(log)!r}, 'a', buffering=1)\n"
        "signal.signal(signal.SIGTERM, lambda s, f: (log.write('TERM\\n'), sys.exit(7)))\n"
        "signal.signal(signal.SIGINT, lambda s, f: log.write('INT\\n'))\n"
        "log.write('ready\\n')\n"
        "time.sleep(30)\n")])
    while not (log.exists() and "ready" in log.read_text()):
        time.sleep(0.05)
    me = os.getpid()
    threading.Timer(0.2, os.kill, (me, signal.SIGINT)).start()  # a terminal's Ctrl-C reaches the child itself
    threading.Timer(0.6, os.kill, (me, signal.SIGTERM)).start()
    assert wait_relaying(child) == 7  # no KeyboardInterrupt here, and the SIGTERM reached the child
    assert log.read_text().splitlines() == ["ready", "TERM"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_train_with_nproc_gives_torchrun_the_runs_collective_timeout_to_stop_in(monkeypatch):
    from typer.testing import CliRunner

    from caspo.cli import app

    launched = {}

    def popen(command, env):
        launched.update(command=command, env=env)
        return "launcher"

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(signals, "wait_relaying", lambda proc: 0 if proc == "launcher" else 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = CliRunner().invoke(app, ["train", "tests", "--nproc", "2", "train.collective_timeout_minutes=45"])
    assert result.exit_code == 0, result.output
    assert launched["command"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert launched["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(45 * 60)
