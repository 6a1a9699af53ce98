"""`caspo suite`: a matched method suite (methods × seeds from one preset), queued one run per device,
each evaluated when it ends, then one `caspo report` of them all.

    caspo suite arith-slips --methods grpo,mu2=grpo+train.epochs_per_rollout=2,vineppo --seeds 0,1,2 \\
        --out runs/slips-suite [--devices 0,1 | --ray-address ADDR --ray-slots N] [--benchmarks math500] [OVERRIDES...]

A methods item is METHOD or LABEL=METHOD, then `+KEY=VALUE` overrides of that item only (the item is its
label when it has none). Every run gets the shared OVERRIDES, method.name=METHOD, the item's overrides,
train.seed and train.output_dir=OUT/<label>/seed<seed>, and on a device list model.device=cuda:<i>. A device
listed k times runs k runs at once, which split one run's KV cache: each gets its config's
rollout.gpu_memory_fraction / k, for training and evaluation (a sample does not depend on the batch it
shares, up to the float rounding of other batch shapes; the report pins the device).

A run is a `caspo train` process (its output in <run>/suite.log). Rerunning the command skips runs whose
status.json says finished, resumes the others from their latest checkpoint and starts over those that
have none; a rerun may add methods or seeds, not change the preset or the shared overrides. With
--benchmarks, `caspo eval` evaluates each finished run's checkpoints not yet in <run>/eval/ (and the base
policy) on the run's device. OUT/suite.json lists the runs and labels; OUT/report/ is the report.

Before the suite is recorded or any run starts, it checks: a seed or a run folder given twice, no seeds,
--ray-slots without --ray-address, each run's config as `caspo train` checks it, --benchmarks as `caspo eval`
checks them, --group-by, suite.json and the runs' status.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from caspo.config import Config, ConfigError, load_config
from caspo.eval.benchmarks import suite_name
from caspo.eval.targets import checkpoint_dirs
from caspo.report.compare import GROUP_BY, expand, read_suite, report
from caspo.runlog import console, read_status, write_json

FORMAT = "caspo-suite-1"
# (preset, overrides, policy=, data=) -> Config: the command line's check of a run's config (cli_args.checked_config)
ConfigCheck = Callable[..., Config]


@dataclass(frozen=True)
class SuiteRun:
    label: str
    seed: int
    dir: str  # relative to the suite folder
    overrides: list[str] = field(default_factory=list)  # the item's: method.name=..., then its own


def split_items(text: str) -> list[str]:
    """Comma-separated items; commas inside [...] or {...} (a YAML list value) stay in their item."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_methods(text: str) -> list[tuple[str, list[str]]]:
    """(label, overrides) of each methods item: METHOD or LABEL=METHOD, then +KEY=VALUE pieces."""
    out = []
    for item in split_items(text):
        head, *pieces = item.split("+")
        label, method = head.split("=", 1) if "=" in head else (item, head)
        if not re.fullmatch(r"[\w.-]+", method) or ("=" in head and not re.fullmatch(r"[\w.-]+", label)):
            raise ValueError(f"--methods item {item!r}: write METHOD or LABEL=METHOD (letters, digits, _ . -), "
                             "then +KEY=VALUE overrides")
        bad = [p for p in pieces if "=" not in p]
        if bad:
            raise ValueError(f"--methods item {item!r}: {bad[0]!r} is not a KEY=VALUE override")
        out.append((label, [f"method.name={method}", *pieces]))
    labels = [label for label, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods {text!r} names a label twice; give variants their own LABEL=METHOD+...")
    return out


def slug(label: str) -> str:
    return re.sub(r"[^\w.=-]+", "_", label)


def plan(methods: list[tuple[str, list[str]]], seeds: list[int]) -> list[SuiteRun]:
    return [SuiteRun(label, seed, f"{slug(label)}/seed{seed}", overrides) for label, overrides in methods
            for seed in seeds]


def next_action(run_dir: Path) -> str:
    """skip (finished), resume (from its latest checkpoint) or fresh (nothing to resume: start over)."""
    status = read_status(run_dir) if run_dir.is_dir() else None
    if status and status.get("state") == "finished":
        return "skip"
    if (run_dir / "checkpoints" / "latest").is_file() and checkpoint_dirs(run_dir):
        return "resume"
    return "fresh"


def train_command(preset: str, shared: list[str], run: SuiteRun, run_dir: Path, device: str | None,
                  action: str, sharing: int = 1) -> list[str]:
    """The run's `caspo train`; `sharing` runs at once on its CUDA device split the KV share of one."""
    args = [sys.executable, "-m", "caspo.cli", "train", preset, *shared, *run.overrides, f"train.seed={run.seed}",
            f"train.output_dir={run_dir}"] + ([f"model.device={device}"] if device else [])
    args += kv_share(device, sharing, lambda: load_config(preset, [*shared, *run.overrides]))
    return args + {"resume": ["--resume", "latest"], "fresh": ["--overwrite"]}[action]


def splits_kv(device: str | None, sharing: int) -> bool:
    return sharing > 1 and (device or "").startswith("cuda")


def kv_share(device: str | None, sharing: int, config) -> list[str]:
    """The override giving one of `sharing` runs at once on a CUDA device its part of the run's KV share
    (`config()`: the run's config), or none."""
    if not splits_kv(device, sharing):
        return []
    return [f"rollout.gpu_memory_fraction={config().rollout.gpu_memory_fraction / sharing:.6g}"]


def eval_command(run_dir: Path, benchmarks: str, device: str | None, sharing: int = 1) -> list[str] | None:
    """`caspo eval` of the run's checkpoints (and base) whose <run>/eval/ result lacks one of `benchmarks`, on
    the benchmarks one of them lacks (`caspo eval` adds them to the results there); None when none lacks any."""
    wanted = {suite_name(b): b for b in benchmarks.split(",") if b}
    missing = {name: [b for n, b in wanted.items() if n not in evaluated(run_dir / "eval" / f"{name}.json")]
               for name in ["base"] + [p.name for p in checkpoint_dirs(run_dir)]}
    todo = [name for name, lacks in missing.items() if lacks]
    if not todo:
        return None
    lacking = [b for b in wanted.values() if any(b in missing[name] for name in todo)]
    share = kv_share(device, sharing, lambda: load_config(run_dir / "config.yaml"))
    return [sys.executable, "-m", "caspo.cli", "eval", str(run_dir), *([f"model.device={device}"] if device else []),
            *share, "--benchmarks", ",".join(lacking), "--checkpoints", ",".join(todo), "--out", str(run_dir / "eval")]


def evaluated(path: Path) -> set[str]:
    """The benchmarks a checkpoint's result holds (none when it has no readable result)."""
    try:
        return set(json.loads(path.read_text()).get("benchmarks", {}))
    except (OSError, ValueError, AttributeError):
        return set()


def record_suite(out: Path, preset: str, shared: list[str], runs: list[SuiteRun]) -> list[SuiteRun]:
    """suite.json: a rerun must keep the preset and shared overrides; its new runs are added."""
    path = out / "suite.json"
    known: list[SuiteRun] = []
    if path.is_file():
        old = read_suite(path)
        if (old["preset"], old["overrides"]) != (preset, shared):
            raise ValueError(f"{out} holds a suite of {old['preset']} with overrides {old['overrides']}; this one is "
                             f"{preset} with {shared}. Use another --out, or the same preset and overrides")
        known = [SuiteRun(**r) for r in old["runs"]]
    by_dir = {r.dir: r for r in known}
    for r in runs:
        if r.dir in by_dir and by_dir[r.dir] != r:
            raise ValueError(f"{out / r.dir}: the suite ran it with overrides {by_dir[r.dir].overrides}, this command "
                             f"gives {r.overrides}; give the variant another LABEL")
        by_dir.setdefault(r.dir, r)
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, {"format": FORMAT, "preset": preset, "overrides": shared,
                      "runs": [asdict(r) for r in by_dir.values()]})
    return list(by_dir.values())


def check_arguments(seeds: list[int], devices: list[str] | None, ray_address: str | None,
                    ray_slots: int | None) -> None:
    """The seeds and the placement options: refused unless the suite can honour them."""
    if not seeds:
        raise ConfigError("--seeds names no seed: give a comma list of train.seed values, e.g. --seeds 0,1,2")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"--seeds {','.join(map(str, seeds))} names seed {', '.join(map(str, twice))} more than "
                          "once (two runs in one folder); list each seed once")
    if ray_slots is not None and not ray_address:
        raise ConfigError(f"--ray-slots {ray_slots} without --ray-address: it sets how many runs go at once on a Ray "
                          "cluster; add --ray-address HOST:PORT (or local), or leave --ray-slots out (--devices "
                          "places the runs on this host)")
    if ray_slots is not None and ray_slots < 1:
        raise ConfigError(f"--ray-slots {ray_slots}: give at least 1 run at a time")
    if ray_address and devices:
        raise ConfigError("--devices and --ray-address both place the runs: give one")


def check_folders(runs: list[SuiteRun], out: Path) -> None:
    """Each run in a folder of its own (two labels can slug to one folder name)."""
    seen: dict[str, SuiteRun] = {}
    for r in runs:
        if r.dir in seen:
            raise ConfigError(f"--methods items {seen[r.dir].label!r} and {r.label!r} would both run in "
                              f"{out / r.dir}; give one of them its own LABEL=METHOD+...")
        seen[r.dir] = r


def benchmark_list(benchmarks: str | None) -> list[str]:
    """--benchmarks as its names (none when it is not given); given but naming none is an error."""
    if benchmarks is None:
        return []
    names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    if not names:
        raise ConfigError(f"--benchmarks {benchmarks!r} names no benchmark: give a comma list as caspo eval takes "
                          "(math500, gsm8k, arith, heldout, a data file, ...), or leave it out")
    return names


def check_configs(checked_config: ConfigCheck, preset: str, shared: list[str], runs: list[SuiteRun], out: Path,
                  benchmarks: list[str] = ()) -> None:
    """Every run's config passes `caspo train`'s checks (`checked_config`: its method, template, data and policy), and
    with `benchmarks` the config of the `caspo eval` of its checkpoints passes `caspo eval`'s, before any run
    starts."""
    for r in runs:
        overrides = [*shared, *r.overrides, f"train.seed={r.seed}", f"train.output_dir={out / r.dir}"]
        try:
            checked_config(preset, overrides)
            if benchmarks:  # as eval_command's `caspo eval`: the run's config, its benchmarks from --benchmarks
                checked_config(preset, [*overrides, f"eval.benchmarks={json.dumps(list(benchmarks))}"],
                               policy=False, data=False)
        except (ConfigError, OSError) as err:  # OSError: a policy folder that is not there
            raise ConfigError(f"suite run {r.label} seed {r.seed}: {err}") from err


class LocalSlots:
    """The suite's runs as processes on this host: one at a time on each device of `devices` (or on the config's
    device, one at a time)."""

    def __init__(self, devices: list[str] | None):
        self.devices: list[str | None] = list(devices) if devices else [None]

    def sharing(self, device: str | None) -> int:
        """How many runs run at once on `device`."""
        return self.devices.count(device)

    def start(self, command: list[str], log: Path) -> subprocess.Popen:
        with log.open("a") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def poll(self, handle: subprocess.Popen) -> int | None:
        return handle.poll()

    def close(self) -> None:
        pass


def run_suite(preset: str, methods: str, seeds: list[int], out: str | Path, *, checked_config: ConfigCheck,
              devices: list[str] | None = None, overrides: list[str] = (), benchmarks: str | None = None,
              group_by: str = "config", slots=None, ray_address: str | None = None,
              ray_slots: int | None = None) -> dict:
    """Run what is not finished, evaluate, report; returns {"report", "ran", "skipped", "failed"}.
    `checked_config(preset, overrides, policy=, data=)` is the command line's check of a config
    (`caspo.cli_args.checked_config`, given by the caller: the suite sits below the command line). `slots` places
    the runs (LocalSlots(devices) by default; caspo.train.ray_launch.RaySlots(ray_address, ray_slots or 1) on a
    Ray cluster). Everything is checked before the suite is recorded or any run starts: the seeds and placement,
    the methods, each run's config, --benchmarks, --group-by, suite.json and the runs' status files."""
    out, shared = Path(out).resolve(), list(overrides)
    check_arguments(seeds, devices, ray_address, ray_slots)
    if group_by not in GROUP_BY:
        raise ConfigError(f"--group-by {group_by!r}: choose one of {', '.join(GROUP_BY)}")
    wanted = plan(parse_methods(methods), seeds)
    check_folders(wanted, out)
    names = benchmark_list(benchmarks)
    benchmarks = ",".join(names) or None
    check_configs(checked_config, preset, shared, wanted, out, names)  # the slow check (each run's data), last
    record_suite(out, preset, shared, wanted)
    queue = [r for r in wanted if next_action(out / r.dir) != "skip"]
    skipped = [r for r in wanted if r not in queue]
    for r in skipped:
        console.print(f"suite: {r.dir} finished, skipped")
    if slots is None and ray_address:
        from caspo.train.ray_launch import RaySlots

        # every run's config, shared overrides included, passed check_configs above
        slots = RaySlots(ray_address, ray_slots or 1, load_config(preset, shared).model.device)
    slots = slots or LocalSlots(devices)
    active: dict[int, tuple[object, SuiteRun, str]] = {}  # slot -> (handle, run, phase)
    failed: list[str] = []
    try:
        while queue or active:
            for slot, device in enumerate(slots.devices):
                while slot not in active and queue:
                    run = queue.pop(0)
                    action = next_action(out / run.dir)
                    if action == "skip":  # finished since the suite began (by another suite on this folder)
                        skipped.append(run)
                        console.print(f"suite: {run.dir} finished meanwhile, skipped")
                        continue
                    sharing = slots.sharing(device)
                    cmd = train_command(preset, shared, run, out / run.dir, device, action, sharing)
                    active[slot] = (start(slots, cmd, out / run.dir), run, "train")
                    note = f" (1/{sharing} of its KV share)" if splits_kv(device, sharing) else ""
                    console.print(f"suite: {run.dir} {'resumed' if action == 'resume' else 'started'} on "
                                  f"{device or 'the config device'}{note}")
            time.sleep(0.2)
            for slot, (handle, run, phase) in list(active.items()):
                code = slots.poll(handle)
                if code is None:
                    continue
                del active[slot]
                log = out / run.dir / "suite.log"
                if code:
                    failed.append(f"{run.dir} ({phase} exited {code}; see {log})")
                    console.print(f"[red]suite: {failed[-1]}[/red]")
                elif phase == "train" and benchmarks and (cmd := eval_command(
                        out / run.dir, benchmarks, slots.devices[slot], slots.sharing(slots.devices[slot]))):
                    active[slot] = (start(slots, cmd, out / run.dir), run, "eval")
                    console.print(f"suite: {run.dir} evaluating its checkpoints")
                else:
                    console.print(f"suite: {run.dir} done")
    finally:
        slots.close()
    runs = expand([str(out)])
    path = report(runs, out / "report", group_by=group_by) if runs else None
    return {"report": str(path) if path else None, "ran": [r.dir for r in wanted if r not in skipped],
            "skipped": [r.dir for r in skipped], "failed": failed}


def start(slots, cmd: list[str], run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "suite.log"
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
    return slots.start(cmd, log)
