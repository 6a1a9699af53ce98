"""`caspo train PRESET --ray-address ADDR --nproc N`: the N ranks of a run placed on a Ray cluster (and
`caspo suite --ray-address`: the suite's runs placed there, `RaySlots`).

One Ray actor per rank, in a placement group of N bundles (one CPU, plus one GPU on CUDA), packed on as
few hosts as the cluster allows. Each actor starts the same `caspo train` command as a child process
with the driver's Python executable, the driver's source path first on PYTHONPATH, the determinism
variables the driver has set, and the torch.distributed variables (rank 0's host and a free port of it
as the rendezvous). The child then joins the process group as under torchrun
(`caspo.train.distributed.start`). `--ray-address local` starts a Ray on this machine for the run.

SIGTERM or Ctrl-C reach the driver alone (the ranks run under Ray's workers, outside the terminal's process
group): the driver asks every rank to stop after its step, with a checkpoint, and waits for them, as torchrun
does for its ranks (`wait_for_ranks`).

Ray is an optional extra: `pip install 'caspo[ray]'`.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

from caspo.config import ConfigError
from caspo.train.signals import StopRequest

# set on the driver, the same on every rank: cuBLAS, NCCL and hashing are then as deterministic as the driver's
PROPAGATED = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG", "PYTHONHASHSEED",
              "CASPO_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
READY_TIMEOUT_S = 120  # for the placement group: a cluster without the resources never schedules it
# how long stopped ranks may take to end (their step and its checkpoint): train.collective_timeout_minutes' default,
# as torchrun is given (caspo.train.distributed.launch_env)
SHUTDOWN_S = 30 * 60
POLL_S = 0.5  # how often the driver looks for a stop signal while it waits for the ranks
KILLED = 128 + signal.SIGKILL  # the status of ranks that outlived their stop: ray.shutdown ends them


def source_path() -> str:
    """The folder the driver imports caspo from (a checkout or site-packages): first on every rank's path."""
    import caspo

    return str(Path(caspo.__file__).resolve().parents[1])


def passed_env(driver_env: dict) -> dict:
    """What a process started on a Ray host takes from the driver: the propagated variables, and PYTHONPATH
    with the driver's source path first."""
    env = {k: driver_env[k] for k in PROPAGATED if k in driver_env}
    path = [source_path(), *filter(None, driver_env.get("PYTHONPATH", "").split(os.pathsep))]
    return env | {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def rank_env(rank: int, world: int, master_addr: str, master_port: int, driver_env: dict) -> dict:
    """What a rank's process gets besides its host's environment."""
    return passed_env(driver_env) | {
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",  # Ray shows each rank its own GPU only
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankProcess:
    """A Ray actor that runs one rank's command as a child process; `stop` ends the child (the actor takes
    two calls at once, so that `stop` reaches it while `run` waits)."""

    def __init__(self):
        self.child = None

    def host(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, command: list[str], env: dict, log: str | None = None) -> int:
        """The command's exit status; its output appended to `log` when given (a path every host sees)."""
        import subprocess

        out = open(log, "a") if log else None
        try:
            self.child = subprocess.Popen(command, env={**os.environ, **env}, stdout=out,
                                          stderr=subprocess.STDOUT if out else None)
            return self.child.wait()
        finally:
            if out:
                out.close()

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()  # SIGTERM: a rank stops after its step, as under Ctrl-C


def connect(address: str, cpus: int):
    """Ray, connected to the cluster at `address`, or to a new one on this machine for 'local' (`cpus` CPUs and
    every GPU here)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray-address needs Ray: pip install 'caspo[ray]'") from None
    if address == "local":
        import torch

        ray.init(num_cpus=cpus, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    else:
        ray.init(address=address)
    return ray


def wants_gpu(ray, device: str) -> bool:
    """Whether a process of model.device `device` takes a GPU: cuda, or auto on a cluster that has GPUs."""
    return device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def exit_status(code: int) -> int:
    """A rank's exit status as a shell reports it: killed by signal s, 128 + s."""
    return code if code >= 0 else 128 - code


def stop_ranks(ray, ranks: list, running) -> None:
    """SIGTERM to each rank in `running`: it stops after its step, with a checkpoint (caspo.train.signals)."""
    ray.get([ranks[r].stop.remote() for r in running])


def wait_for_ranks(ray, ranks: list, runs: dict, shutdown_s: float) -> int:
    """Wait for the ranks' `run` calls (`runs`: each call's ref -> its rank) and return the status of the first
    rank that failed, or 0.

    The first failure, SIGTERM or Ctrl-C asks every rank still running to stop, once: a failure because the others
    would wait for it in a collective, a signal because it reaches this driver alone (Ray's workers are not in
    the terminal's process group). The ranks then have `shutdown_s` to end, as torchrun's ranks have; a second
    signal within signals.REPEAT_WINDOW_S is taken for a copy of the first, a later one interrupts at once."""
    status, deadline = 0, None
    with StopRequest() as request:  # after ray.init, whose SIGTERM handler would exit without the ranks
        while runs:
            if deadline is None and (status or request.requested):
                if request.requested:
                    print(f"{request.requested}: asking the {len(runs)} ranks to stop after their step, "
                          f"with a checkpoint (waiting up to {shutdown_s:g} s)", file=sys.stderr, flush=True)
                stop_ranks(ray, ranks, runs.values())
                deadline = time.monotonic() + shutdown_s
            if deadline is not None and time.monotonic() >= deadline:
                print(f"ranks {sorted(runs.values())} did not end within {shutdown_s:g} s of their stop; ending "
                      "them", file=sys.stderr, flush=True)
                return status or KILLED
            ready, _ = ray.wait(list(runs), num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank, code = runs.pop(ref), exit_status(ray.get(ref))
                if code and not status:  # a peer stopped because of this failure exits with its own status
                    print(f"rank {rank} exited with status {code}; stopping the others", file=sys.stderr,
                          flush=True)
                    status = code
    return status


def launch(address: str, nproc: int, argv: Sequence[str], device: str, shutdown_s: float = SHUTDOWN_S) -> int:
    """Run `caspo <argv>` as `nproc` ranks on the Ray cluster at `address` ('local': a new local Ray), on
    GPUs when `device` (model.device) is cuda, or auto and the cluster has GPUs; returns the exit status of
    the first rank that failed, or 0. A failure, SIGTERM or Ctrl-C stops the ranks after their step
    (`wait_for_ranks`), and they have `shutdown_s` (train.collective_timeout_minutes) to end."""
    ray = connect(address, nproc)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        on_cuda = wants_gpu(ray, device)
        bundle = {"CPU": 1, **({"GPU": 1} if on_cuda else {})}
        group = placement_group([bundle] * nproc, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources()
            raise ConfigError(f"the Ray cluster at {address} cannot place {nproc} ranks of {bundle} (it has "
                              f"{free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free); lower --nproc"
                              ) from None
        actor = ray.remote(num_cpus=1, num_gpus=1 if on_cuda else 0, max_concurrency=2)(RankProcess)
        ranks = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=r)).remote() for r in range(nproc)]
        master_addr, master_port = ray.get(ranks[0].host.remote())
        command = [sys.executable, "-m", "caspo.cli", *argv]
        runs = {a.run.remote(command, rank_env(r, nproc, master_addr, master_port, dict(os.environ))): r
                for r, a in enumerate(ranks)}
        return wait_for_ranks(ray, ranks, runs, shutdown_s)
    finally:
        ray.shutdown()


class RaySlots:
    """`caspo suite --ray-address`: each queued command as a Ray actor of one CPU (plus one GPU on CUDA), up to
    `slots` at a time; Ray picks the host and, on CUDA, the device (the command runs with model.device=cuda)."""

    def __init__(self, address: str, slots: int, device: str):
        """`device`: the runs' model.device; cuda, or auto on a cluster with GPUs, gives each run a GPU."""
        self.ray = ray = connect(address, slots)
        on_cuda = wants_gpu(ray, device)
        self.actor = ray.remote(num_cpus=1, num_gpus=1 if on_cuda else 0, max_concurrency=2)(RankProcess)
        self.devices: list[str | None] = ["cuda" if on_cuda else None] * slots

    def sharing(self, device: str | None) -> int:
        return 1  # Ray gives each run a GPU of its own

    def start(self, command: list[str], log: Path):
        actor = self.actor.remote()
        return actor, actor.run.remote(command, passed_env(dict(os.environ)), str(log))

    def poll(self, handle) -> int | None:
        actor, ref = handle
        ready, _ = self.ray.wait([ref], timeout=0)
        return self.ray.get(ref) if ready else None

    def close(self) -> None:
        self.ray.shutdown()
