"""`caspo verify-resume`: is a stopped-and-resumed run bit-identical to an uninterrupted one?

Three runs, each in a fresh process and in deterministic mode:
    uninterrupted/   three outer steps
    resumed/         two steps (train.stop_after=2), then `--resume latest` for the third
Then the final checkpoints and the per-step traces are compared by hash. With `nproc` > 1 each
run has that many processes; the sharded state (models, optimizers, each rank's RNG) is read back
from its DCP shards and hashed as whole tensors.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.table import Table

from caspo.config import ConfigError
from caspo.config.load import leaves, parse_override
from caspo.runlog import console
from caspo.train.checkpoint import SHARDS, is_sharded, load_rank_state, load_trainer_state, resolve_checkpoint

STEPS = 3
STOP_AFTER = 2
# What verify-resume sets itself, on every run: an override giving one of them another value is refused
# (train.output_dir and train.stop_after differ between the runs, so any value of them is).
FIXED = {"train.steps": STEPS, "train.deterministic": True, "eval.before": False, "eval.after": False,
         "train.save_every": 0}
PER_RUN = {"train.output_dir": "its runs go in --workdir",
           "train.stop_after": f"it stops one run after {STOP_AFTER} steps"}


class RunFailed(ConfigError):
    """One of verify-resume's `caspo train` processes failed: its last error line, and where its output is."""


def check_overrides(overrides: list[str]) -> None:
    """Refuse an override of a setting verify-resume makes itself (FIXED, PER_RUN), unless it gives FIXED's value:
    appended after the user's, verify-resume's own would silently win."""
    for item in overrides:
        key, value = parse_override(item)
        for name, given in leaves(value, key):
            if name in PER_RUN:
                raise ConfigError(f"{item}: verify-resume sets {name} itself ({PER_RUN[name]}); leave it out")
            if name in FIXED and given != FIXED[name]:
                fixed = str(FIXED[name]).lower() if isinstance(FIXED[name], bool) else FIXED[name]
                raise ConfigError(f"{item}: verify-resume sets {name}={fixed} itself ({STEPS} steps against "
                                  f"{STOP_AFTER} + a resumed {STEPS - STOP_AFTER}, deterministic, not evaluated, "
                                  "saved at the stop and the end); leave it out")


def digest(obj) -> str:
    """A hash of nested dicts/lists of tensors, numbers and strings."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"K{k}".encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"L")
            for v in x:
                feed(v)
        else:
            buf = io.BytesIO()
            buf.write(repr(x).encode())
            h.update(buf.getvalue())

    feed(obj)
    return h.hexdigest()[:16]


def run_cli(args: list[str], log: Path) -> None:
    """One `caspo train` of verify-resume, its output written to `log` (<workdir>/<run>.log). A failure is a
    RunFailed with the run's last error line."""
    cmd = [sys.executable, "-m", "caspo.cli", "train", *args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}")
    if result.returncode:
        raise RunFailed(f"the {log.stem} run exited {result.returncode}: {last_error(result.stderr)} "
                        f"(its output: {log})")


def last_error(stderr: str) -> str:
    """The line of a failed `caspo` process that says why: its `<command> error: ...` line, else (a traceback)
    its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if re.match(r"[\w-]+ error: ", line)]
    return (said or lines or ["(it printed nothing)"])[-1]


def _measured(key: str) -> bool:
    """Timers, memory, and counts of what a process compiles or captures (a resumed one starts with none)."""
    return key.startswith(("t_", "mem_")) or key == "compiled_graphs" or key.endswith("_graph_captures")


def traces(run_dir: Path) -> dict[str, str]:
    """Per-run hashes of what the steps produced: tokens, rewards, and metrics without timers, memory
    figures and compilation or graph-capture counts (which a process that resumed measures differently)."""
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{k: v for k, v in m.items() if not _measured(k)} for m in metrics if "reward_mean" in m]
    return {
        "sampled tokens": digest([s["tokens_digest"] for s in samples]),
        "sample texts": digest([s["text"] for s in samples]),
        "rewards": digest([s["reward"] for s in samples]),
        "policy versions": digest([s["policy_version"] for s in samples]),
        "per-step metrics": digest(steps),
    }


def sharded_state(ckpt: Path) -> dict:
    """A sharded checkpoint's DCP state as whole tensors ({"models": ..., "optimizers": ...}) and every
    rank's own state (its RNG states, its shards of the engine's old versions), read in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt / SHARDS, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=True)
    ranks = [load_rank_state(ckpt, r) for r in range(len(list((ckpt / "ranks").glob("rank_*.pt"))))]
    return state | {"rng": [r["rng"] for r in ranks], "snapshots": [r["snapshots"] for r in ranks]}


def state_hashes(run_dir: Path) -> dict[str, str]:
    ckpt = resolve_checkpoint(run_dir)
    state = load_trainer_state(ckpt)
    from safetensors.torch import load_file

    weights = {p.parent.name: load_file(p) for p in sorted(ckpt.glob("*/model.safetensors"))}
    out = {f"{name} weights": digest(w) for name, w in weights.items()}
    if is_sharded(ckpt):
        state |= sharded_state(ckpt)
        out["master weights"] = digest(state.pop("models"))
    if "master_weights" in state:
        out["master weights"] = digest(state["master_weights"])
    for key in ("optimizers", "schedulers", "loss_scaler", "cursor", "update_rng", "rng", "snapshots"):
        out[key.replace("_", " ")] = digest(state[key])
    out["step / version"] = f"{state['step']} / {state['version']}"
    return out


def verify_resume(preset: str, overrides: list[str], workdir: str | Path, nproc: int = 1) -> bool:
    check_overrides(overrides)
    workdir = Path(workdir)
    base = [preset, *overrides, f"train.steps={STEPS}", "train.deterministic=true",
            "eval.before=false", "eval.after=false", "train.save_every=0"]
    base += ["--nproc", str(nproc)] if nproc > 1 else []
    straight, resumed = workdir / "uninterrupted", workdir / "resumed"
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)
    with console.status("uninterrupted run"):
        run_cli(base + [f"train.output_dir={straight}"], workdir / "uninterrupted.log")
    with console.status(f"run stopped after {STOP_AFTER} steps"):
        run_cli(base + [f"train.output_dir={resumed}", f"train.stop_after={STOP_AFTER}"], workdir / "stopped.log")
    with console.status("resumed run"):
        run_cli(base + [f"train.output_dir={resumed}", "--resume", "latest"], workdir / "resumed.log")
    a = {**state_hashes(straight), **traces(straight)}
    b = {**state_hashes(resumed), **traces(resumed)}
    ranks = f", {nproc} processes" if nproc > 1 else ""
    table = Table(title=f"verify-resume: {STEPS} steps vs {STOP_AFTER} + resumed {STEPS - STOP_AFTER}{ranks}")
    for col in ("item", "uninterrupted", "resumed", "identical"):
        table.add_column(col)
    ok = True
    for key in a:
        same = a[key] == b.get(key)
        ok &= same
        table.add_row(key, a[key], b.get(key, "missing"), "[green]yes[/green]" if same else "[red]NO[/red]")
    console.print(table)
    return ok
