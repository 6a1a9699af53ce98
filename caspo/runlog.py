"""What a run writes as it goes: metrics.jsonl (one line a step), samples.jsonl (one line a sample),
run.json (what the run ran on, one entry per process that ran it) and status.json (running, stalled,
finished, stopped or failed; rewritten as the run goes)."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from caspo.config.load import read_text_checked

console = Console(stderr=True)

PACKAGES = ("caspo", "torch", "transformers", "tokenizers", "safetensors", "math-verify", "numpy", "triton",
            "tensorboard", "wandb")
# The machine counts as shared when the 1-minute load average is at least this fraction of its CPUs
# when the run starts, or another process holds more than SHARED_GPU_MB of the run's GPU.
SHARED_LOAD_FRACTION = 0.5
SHARED_GPU_MB = 1024


class DamagedRunFile(ValueError):
    """A run's or suite's own file (metrics.jsonl, samples.jsonl, run.json, status.json, config.yaml as a report
    reads it, suite.json) that cannot be read back."""


MEND = "mend it, or move it away"
KINDS = {dict: "a mapping", list: "a list", str: "a string", int: "an integer"}


def kind_of(value) -> str:
    """What a JSON or YAML value is, in words (a mapping, a list, a string, null, ...)."""
    if value is None:
        return "null"
    return next((name for t, name in KINDS.items() if isinstance(value, t) and not isinstance(value, bool)),
                type(value).__name__)


def read_mapping(path: str | Path, needs: dict | None = None, fix: str = MEND) -> dict:
    """A run's or suite's JSON file, or YAML file (by its suffix), as the mapping it must be, holding each key
    of `needs` with a value of its type ([dict]: a list of mappings). Anything else (not UTF-8, not valid JSON or
    YAML, not a mapping, a key missing or of another type) is a DamagedRunFile naming the file, what is wrong
    with it and `fix` (re-saving it, for text that is not UTF-8)."""
    path = Path(path)
    kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
    text = read_text_checked(path, DamagedRunFile)
    try:
        data = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except (ValueError, yaml.YAMLError) as err:  # json.JSONDecodeError is a ValueError
        raise DamagedRunFile(f"{path}: not valid {kind} ({' '.join(str(err).split())}); {fix}") from None
    if not isinstance(data, dict):
        raise DamagedRunFile(f"{path}: holds {kind_of(data)}, not the mapping caspo writes there; {fix}")
    check_keys(path, data, needs or {}, fix)
    return data


def check_keys(path: str | Path, data: dict, needs: dict, fix: str = MEND) -> None:
    """`read_mapping`'s check of the keys `needs` of a file's mapping `data`, for a reader that needs more of it
    than others do."""
    for key, want in needs.items():
        value = data.get(key)
        if isinstance(want, list):
            ok = isinstance(value, list) and all(isinstance(v, want[0]) for v in value)
            what = f"a list of {KINDS[want[0]].split(' ', 1)[1]}s"  # a list of mappings
        else:
            ok, what = isinstance(value, want) and not isinstance(value, bool), KINDS[want]
        if key not in data:
            raise DamagedRunFile(f"{path}: has no {key!r} ({what}); {fix}")
        if not ok:
            raise DamagedRunFile(f"{path}: its {key!r} is {kind_of(value)}, not {what}; {fix}")


class JsonlWriter:
    def __init__(self, path: Path, truncate_after_step: int | None = None,
                 drop: Callable[[dict], bool] | None = None):
        """Append to `path`; on resume, first drop lines of steps after `truncate_after_step`
        and lines for which `drop(record)` holds (records the resumed run writes again). The kept lines
        are streamed, as they were, into a new file that then replaces the old: a crash meanwhile loses nothing."""
        self.path = path
        if truncate_after_step is not None and path.exists():
            def kept(record: dict) -> bool:
                return record.get("step", -1) <= truncate_after_step and not (drop and drop(record))

            tmp = path.with_name(f".{path.name}.tmp")
            try:
                with tmp.open("w", encoding="utf-8") as out:
                    for record, line in iter_jsonl(path):
                        if kept(record):
                            out.write(line if line.endswith("\n") else line + "\n")
                    out.flush()
                    os.fsync(out.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def iter_jsonl(path: str | Path):
    """(record, line) of each line of a JSONL file, read as it streams, as a running or crashed run left it: a
    last line cut short by a crash is left out; a bad line anywhere else is an error naming the file and line."""
    bad = None  # (line number, error) of a line that is not JSON: an error unless nothing follows it
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            if bad is not None:
                raise DamagedRunFile(f"{path}, line {bad[0]}: not JSON ({bad[1]}); the file is damaged before its "
                                     "end: mend or remove that line")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                bad = (i, err)
                continue
            if not isinstance(record, dict):
                raise DamagedRunFile(f"{path}, line {i}: {kind_of(record)}, not a JSON object (a mapping) as a run "
                                     "writes; mend or remove that line")
            yield record, line


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file (`iter_jsonl`)."""
    return [record for record, _ in iter_jsonl(path)]


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class StatusFile:
    """<run>/status.json: the run's state, its last finished step and when; safe to update from two threads."""

    def __init__(self, path: Path, total_steps: int):
        self.path, self.lock = path, threading.Lock()
        self.status = {"state": "running", "step": 0, "steps": total_steps, "pid": os.getpid(), "started_at": now(),
                       "updated_at": now(), "last_step_at": None, "message": ""}

    def update(self, **fields) -> None:
        with self.lock:
            self.status.update(fields, updated_at=now())
            write_json(self.path, self.status)


def read_status(run_dir: str | Path) -> dict | None:
    """<run>/status.json (None when the run has none); a damaged one is a DamagedRunFile."""
    path = Path(run_dir) / "status.json"
    return read_mapping(path, fix="mend it, or remove it (a running run writes it anew)") if path.is_file() else None


# ---------------------------------------------------------------- run.json


def git_commit(where: Path) -> dict:
    """The commit of the checkout holding `where`, and whether it had uncommitted changes; {} outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def machine_load(cuda_device: int | None = None) -> dict:
    """How busy the machine is before the run loads anything: load average, CPUs, and on CUDA the memory
    other processes hold on the run's GPU; `shared` by the rule of SHARED_LOAD_FRACTION / SHARED_GPU_MB."""
    cpus = os.cpu_count() or 1
    load = {"cpus": cpus}
    reasons = []
    if hasattr(os, "getloadavg"):
        load["load_1m"], load["load_5m"], load["load_15m"] = (round(x, 2) for x in os.getloadavg())
        if load["load_1m"] >= SHARED_LOAD_FRACTION * cpus:
            reasons.append(f"1-minute load {load['load_1m']} on {cpus} CPUs")
    if cuda_device is not None:
        import torch

        free, total = torch.cuda.mem_get_info(cuda_device)
        used_mb = (total - free - torch.cuda.memory_reserved(cuda_device)) / 2**20
        load["gpu_used_mb_by_others"] = round(used_mb)
        if used_mb > SHARED_GPU_MB:
            reasons.append(f"{used_mb:.0f} MB of GPU {cuda_device} held by other processes")
    load["shared"] = bool(reasons)
    load["shared_why"] = "; ".join(reasons)
    return load


def device_name(device) -> str:
    """The accelerator's name (a torch.device of type cuda), else the CPU's model name."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_start(*, step: int, device: str, device_name: str, precision: str, engine_dtype: str, load: dict,
              command: list[str] | None = None) -> dict:
    """One entry of run.json's `starts`: what this process runs on."""
    return {"started_at": now(), "step": step, "command": list(sys.argv if command is None else command),
            "cwd": os.getcwd(), "host": socket.gethostname(), "pid": os.getpid(),
            "git": git_commit(Path(__file__).parent), "packages": package_versions(), "platform": platform.platform(),
            "device": device, "device_name": device_name, "precision": precision, "engine_dtype": engine_dtype,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "load_at_start": load,
            **({"cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")} if device.startswith("cuda") else {})}


RUN_JSON = {"starts": [dict]}
RUN_JSON_FIX = "mend it, or move it away to start a new record"


def record_start(run_dir: Path, start: dict, resumed: bool) -> dict:
    """Append `start` to <run>/run.json (a fresh run begins a new file); returns the whole record."""
    path = run_dir / "run.json"
    record = {"format": "caspo-run-1", "starts": []}
    if resumed and path.is_file():
        record = read_mapping(path, RUN_JSON, fix=RUN_JSON_FIX)
    record["starts"].append(start)
    write_json(path, record)
    return record


def record_end(run_dir: Path, record: dict, **end) -> None:
    """The end of the latest start: how it ended, the step reached, the load seen while it ran."""
    record["starts"][-1]["end"] = {"ended_at": now(), **end}
    write_json(run_dir / "run.json", record)


def read_run_json(run_dir: str | Path) -> dict | None:
    """<run>/run.json (None when the run has none); a damaged one is a DamagedRunFile."""
    path = Path(run_dir) / "run.json"
    return read_mapping(path, RUN_JSON, fix=RUN_JSON_FIX) if path.is_file() else None


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    )
