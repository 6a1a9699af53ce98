"""`caspo report RUN [RUN ...] --out DIR`: one run's curves, or runs × seeds compared, as PNGs and report.md
(+ summary.json, the same numbers for programs).

Runs are grouped by config (runs whose configs differ only in seed, folder and logging are seeds of one
group), by method (method.name) or not at all (run). A group's numbers are the mean over its runs ± the
half-width of the 95% t interval of that mean (summary.json adds the sample std). Runs compared must share
the conditions (CONDITIONS: model, data and template, verifier, sampler, evaluation) unless allow_mismatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from caspo.config import leaves
from caspo.report.curves import plot_curves, plot_phases, plot_vs_compute
from caspo.report.runs import CONFIG_FIX, CONFIG_SECTIONS, PHASES, Run, age_s, final, mean_std, read_run
from caspo.runlog import DamagedRunFile, check_keys, read_mapping

CONDITIONS = {"model": ["policy"], "data": None,  # None: the whole section
              "reward": ["extractor", "fallback", "max_answer_chars", "synthetic", "shuffle_within_batch"],
              "rollout": ["temperature", "top_p", "top_k", "max_new_tokens", "stop"],
              "eval": ["heldout_size", "max_new_tokens", "samples", "temperature", "top_p", "benchmarks", "limit"]}
# not part of what a run is: which seed, where, on which device (and its share of it), how it is logged and watched
NOT_CONFIG = {"train.seed", "train.output_dir", "model.device", "model.threads", "train.loggers", "train.log_samples",
              "train.curves", "train.stop_after", "train.save_every", "train.save_last", "reward.workers",
              "rollout.gpu_memory_fraction"}
NOT_CONFIG_SECTIONS = ("train.wandb.", "train.health.")
LAST = 5  # training metrics are averaged over a run's last LAST steps
GROUP_BY = ("config", "method", "run")
COMPUTE = ("policy_tokens", "mc_tokens", "value_tokens", "refresh_tokens", "wall_s")  # the report's compute table


def conditions(config: dict) -> dict:
    out = {}
    for section, keys in CONDITIONS.items():
        values = dict(leaves(config.get(section, {}), section))
        out |= {k: v for k, v in values.items() if keys is None or k.split(".", 1)[1] in keys}
    return out


def check_conditions(runs: list[Run]) -> list[str]:
    """The condition keys on which `runs` disagree, each with its values."""
    per_run = [conditions(r.config) for r in runs]
    keys = sorted(set().union(*per_run))
    return [f"{k}: " + ", ".join(f"{r.name}={c.get(k)!r}" for r, c in zip(runs, per_run))
            for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in per_run}) > 1]


def config_key(config: dict) -> dict:
    return {k: v for k, v in leaves(config)
            if k not in NOT_CONFIG and not k.startswith(NOT_CONFIG_SECTIONS)}


def group_runs(runs: list[Run], by: str = "config") -> dict[str, list[Run]]:
    """Label -> runs. Labels given to the runs (a suite's) win; else by config: the method and the keys
    where the group's config differs from the others'; by method: method.name; by run: the folder."""
    if by not in GROUP_BY:
        raise ValueError(f"--group-by {by!r}: choose one of {', '.join(GROUP_BY)}")
    if by == "run":
        return {f"{r.path.parent.name}/{r.name}" if r.path.parent.name else r.name: [r] for r in runs}
    if by == "method":
        methods = dict.fromkeys(r.config["method"]["name"] for r in runs)
        return {m: [r for r in runs if r.config["method"]["name"] == m] for m in methods}
    groups: dict[str, list[Run]] = {}
    keys: dict[str, dict] = {}
    for r in runs:
        k = json.dumps(config_key(r.config), sort_keys=True, default=str)
        groups.setdefault(k, []).append(r)
        keys[k] = config_key(r.config)
    varying = sorted({name for k in keys for name in keys[k]
                      if len({json.dumps(keys[j].get(name), default=str) for j in keys}) > 1} - {"method.name"})
    out = {}
    for k, members in groups.items():
        given = {r.label for r in members if r.label}
        if len(given) == 1:
            label = given.pop()
        else:
            label = " ".join([keys[k]["method.name"]] + [f"{n}={keys[k].get(n)}" for n in varying])
        out[label if label not in out else f"{label} ({len(out)})"] = members
    return out


# ---------------------------------------------------------------- the numbers


def metric_keys(runs: list[Run]) -> list[str]:
    """Evaluation metrics a report shows: held-out greedy and avg@k, each benchmark's greedy."""
    keys = {k for r in runs for rec in r.records for k in rec
            if k in ("eval_accuracy", "eval_sampled_accuracy") or (k.startswith("bench_") and k.endswith("_greedy"))}
    return sorted(keys, key=lambda k: (not k.startswith("eval_"), k))


def eval_metrics(run: Run) -> dict[str, float]:
    """The latest checkpoint's benchmark metrics from eval/: <benchmark> <greedy | avg@K | pass@k | maj@K>."""
    last = run.last_eval()
    if last is None:
        return {}
    return {f"{name} {m}": v for name, bench in last["benchmarks"].items() for m, v in bench["metrics"].items()
            if isinstance(v, (int, float))}


def run_numbers(run: Run) -> dict[str, float]:
    """One run's numbers: training metrics over its last LAST steps, the last evaluation of each metric,
    compute totals, wall-clock."""
    out: dict[str, float] = {}
    for key in ("reward_mean", "pass_at_g", "kl", "response_len_mean", "steps_per_response"):
        if (v := final(run, key, LAST)) is not None:
            out[f"{key} (last {LAST})"] = v
    for key in metric_keys([run]):
        if (v := final(run, key)) is not None:
            out[key] = v
    out |= eval_metrics(run)
    out["steps"] = float(len(run.steps))
    out["policy_tokens"] = run.total("policy_tokens") or sum(r["response_len_mean"] * run.responses_per_step
                                                             for r in run.steps)
    out["mc_tokens"] = run.total("mc_tokens")
    out["value_tokens"] = run.total("value_tokens")
    # a refresh's labelling rollouts and continuations; a run resumed at a refresh logs it again; runs from
    # before refreshes counted their tokens leave the figure out rather than report 0
    refreshes = {r["step"]: r.get("refresh_tokens") for r in run.records if "refresh_value_model" in r}
    if None not in refreshes.values():
        out["refresh_tokens"] = float(sum(refreshes.values()))
    out["wall_s"] = run.wall_s()
    return out


def group_numbers(groups: dict[str, list[Run]]) -> dict[str, dict[str, dict]]:
    """label -> metric -> mean_std over the group's runs (those that have the metric)."""
    out = {}
    for label, runs in groups.items():
        per_run = [run_numbers(r) for r in runs]
        keys = list(dict.fromkeys(k for p in per_run for k in p))
        out[label] = {k: mean_std([p[k] for p in per_run if k in p]) for k in keys}
    return out


def timing(run: Run) -> dict[str, float]:
    """Mean seconds per step of each phase and of the step; totals of checkpoints, evaluation, refreshes."""
    steps = run.steps
    out = {p: sum(r.get(p, 0.0) for r in steps) / max(len(steps), 1) for p in PHASES + ("t_step",)}
    for k in ("t_ckpt", "t_eval", "t_bench", "t_refresh"):
        out[f"{k} total"] = sum(r.get(k, 0.0) for r in run.records)
    out["wall_s"] = run.wall_s()
    return out


def pins(run: Run) -> dict[str, str]:
    """What the numbers were measured on: every distinct value over the run's starts (a resume may differ)."""
    starts = (run.run_json or {}).get("starts", [])

    def distinct(fn) -> str:
        values = list(dict.fromkeys(fn(s) for s in starts))
        return " / ".join(values) if values else "?"
    return {
        "commit": distinct(lambda s: (s["git"].get("commit", "?")[:10] + ("+dirty" if s["git"].get("dirty") else ""))
                           if s.get("git") else "no git"),
        "dtype": distinct(lambda s: f"{s['precision']} (engine {s['engine_dtype']})"),
        "device": distinct(lambda s: f"{s['device']} {s['device_name']}"),
        "world": distinct(lambda s: str(s.get("world_size", 1))),
        "shared": distinct(lambda s: ("yes: " + s["load_at_start"]["shared_why"]) if s["load_at_start"]["shared"]
                           else f"no (load {s['load_at_start'].get('load_1m', '?')} on {s['load_at_start']['cpus']})"),
        "load during": distinct(lambda s: f"{s.get('end', {}).get('load_1m_max', '?')} max"),
    }


def state_note(run: Run) -> str:
    state, age = run.state, age_s(run.status)
    if state in ("running", "stalled") and age is not None:
        return f"{state} (updated {age / 60:.0f} min ago)"
    return state


# ---------------------------------------------------------------- writing it


def fmt(stat: dict, integer: bool = False, runs: int = 1) -> str:
    """mean ± 95% interval half-width (n) of a group of `runs` runs; the mean alone for one run, with (n=...)
    when fewer than the group's runs have the metric."""
    if not stat or stat["n"] == 0 or math.isnan(stat["mean"]):
        return ""
    one = (lambda v: f"{v:,.0f}") if integer or abs(stat["mean"]) >= 1000 else (lambda v: f"{v:.3f}")
    if stat["n"] == 1 or (integer and stat["std"] == 0):  # counts all equal: the count alone
        return one(stat["mean"]) + (f" (n={stat['n']})" if stat["n"] < runs else "")
    return one(stat["mean"]) + f" ± {one(stat['ci95'])} (n={stat['n']})"


def caveats(groups: dict[str, list[Run]]) -> list[str]:
    """What makes a group's mean less than a mean over seeds: runs at different progress (steps, or their last
    evaluation), or several runs of one seed."""
    out = []
    for label, members in groups.items():
        if len(members) < 2:
            continue
        if len({len(r.steps) for r in members}) > 1:
            out.append(f"{label}: its runs stopped at different steps ("
                       + ", ".join(f"{r.name} {len(r.steps)}" for r in members) + "); their means mix progress")
        evals = {r.name: (r.last_eval() or {}).get("step") for r in members}
        if len(set(evals.values())) > 1:
            out.append(f"{label}: the runs' last evaluations are of different steps ("
                       + ", ".join(f"{n} {s if s is not None else 'none'}" for n, s in evals.items()) + ")")
        seeds = [r.seed for r in members]
        for seed in dict.fromkeys(x for x in seeds if seeds.count(x) > 1):
            out.append(f"{label}: {seeds.count(seed)} runs of seed {seed} count as that many seeds")
    return out


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def report(runs: list[Run], out: str | Path, group_by: str = "config", allow_mismatch: bool = False) -> Path:
    """Write <out>/report.md, summary.json, curves.png, phases.png and <metric>_vs_compute.png."""
    if not runs:
        raise ValueError("no runs to report on")
    for r in runs:
        check_keys(r.path / "config.yaml", r.config, CONFIG_SECTIONS, CONFIG_FIX)
    paths = [r.path.resolve() for r in runs]
    twice = sorted({str(p) for p in paths if paths.count(p) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} given more than once; name each run once")
    mismatch = check_conditions(runs)
    if mismatch and not allow_mismatch:
        raise ValueError("these runs were not made under the same conditions, so their numbers do not compare:\n  "
                         + "\n  ".join(mismatch) + "\n(pass --allow-mismatch to report on them anyway)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, group_by)
    numbers = group_numbers(groups)
    figures = [plot_curves(groups, out / "curves.png", phases=len(runs) == 1), plot_phases(groups, out / "phases.png")]
    for key in metric_keys(runs)[:3]:
        figures.append(plot_vs_compute(groups, key, out / f"{key}_vs_compute.png", key))
    lines = [f"# caspo report: {len(runs)} run(s) in {len(groups)} group(s)", ""]
    if mismatch:
        lines += ["**Conditions differ** (reported with --allow-mismatch):", ""] + [f"- {m}" for m in mismatch] + [""]
    metric_cols = list(dict.fromkeys(k for g in numbers.values() for k in g
                                     if k not in ("steps", *COMPUTE)))
    lines += ["## Results", "", "Mean over each group's runs ± the half-width of its 95% t interval (n); training "
              f"metrics averaged over each run's last {LAST} steps, evaluations at each run's last one.", ""]
    size = {label: len(members) for label, members in groups.items()}
    lines += table(["group", "runs", "steps", *metric_cols],
                   [[label, str(size[label]), fmt(g.get("steps", {}), integer=True, runs=size[label])]
                    + [fmt(g.get(k, {}), runs=size[label]) for k in metric_cols] for label, g in numbers.items()])
    warnings = caveats(groups)
    if warnings:
        lines += ["", "**Caveats:**", ""] + [f"- {w}" for w in warnings]
    lines += per_seed_table(groups, [k for k in metric_cols if "(last" not in k])
    lines += ["", "## Compute", ""]
    lines += ["Tokens generated or read per run: the policy's responses, Monte Carlo continuations (VinePPO), "
              "value-model reads (CASPO), and a refresh's labelling (its rollouts and their continuations).", ""]
    lines += table(["group", "policy tokens", "Monte Carlo tokens", "value-model tokens", "refresh tokens",
                    "wall-clock (s)"],
                   [[label] + [fmt(g.get(k, {}), integer=True, runs=size[label]) or "not recorded" for k in COMPUTE]
                    for label, g in numbers.items()])
    lines += ["", "## Runs", ""]
    pin_rows = []
    for label, members in groups.items():
        for r in members:
            p = pins(r)
            pin_rows.append([r.name, label, str(r.seed), state_note(r), f"{len(r.steps)}/{r.config['train']['steps']}",
                             p["commit"], p["dtype"], p["device"], p["world"], p["shared"], p["load during"]])
    lines += table(["run", "group", "seed", "state", "steps", "commit", "dtype", "device", "world", "shared at start",
                    "load (1 min) during"], pin_rows)
    lines += ["", "## Timing", "", "Mean seconds per step by phase (inside t_step), then totals.", ""]
    time_cols = list(PHASES) + ["t_step", "t_ckpt total", "t_eval total", "t_bench total", "t_refresh total",
                                "wall_s"]
    lines += table(["group", "seed", *time_cols], [[label, str(r.seed)] + [f"{timing(r)[c]:.2f}" for c in time_cols]
                                                   for label, members in groups.items() for r in members])
    alarms = [(r.name, rec["step"], a) for r in runs for rec in r.records for a in rec.get("health", [])]
    lines += ["", "## Health", ""] + ([f"- {n}, step {s}: train.health.{a} fired" for n, s, a in alarms]
                                      or ["No detector fired."])
    lines += ["", "## Figures", ""] + [f"![{f.stem}]({f.name})" for f in figures] + [""]
    (out / "report.md").write_text("\n".join(lines))
    summary = {"groups": {label: {"runs": [str(r.path) for r in groups[label]], "numbers": numbers[label]}
                          for label in groups},
               "runs": {str(r.path): {"state": r.state, "numbers": run_numbers(r), "timing": timing(r), "pins": pins(r)}
                        for r in runs},
               "mismatch": mismatch, "caveats": warnings}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return out / "report.md"


def per_seed_table(groups: dict[str, list[Run]], keys: list[str]) -> list[str]:
    """Each evaluation metric at each run's last evaluation, a row per group and a column per seed: the
    numbers behind a group's interval."""
    seeds = sorted({r.seed for members in groups.values() for r in members}, key=str)
    if not keys or len(seeds) < 2:
        return []
    lines = ["", "## Per seed", "", "Each run's last evaluation.", ""]
    numbers = {id(r): run_numbers(r) for members in groups.values() for r in members}
    rows = []
    for key in keys:
        for label, members in groups.items():
            by_seed: dict = {}  # a group pooled by method may hold two runs of one seed
            for r in members:
                if (v := numbers[id(r)].get(key)) is not None:
                    by_seed.setdefault(r.seed, []).append(f"{v:.4f}")
            rows.append([key, label] + [" / ".join(by_seed.get(s, ["—"])) for s in seeds])
    return lines + table(["metric", "group", *(f"seed {s}" for s in seeds)], rows)


def expand(paths: list[str]) -> list[Run]:
    """Run folders, and suite folders (holding suite.json) as the runs they hold, labelled by the suite."""
    runs = []
    for p in map(Path, paths):
        if (p / "suite.json").is_file():
            suite = read_suite(p / "suite.json")
            runs += [read_run(p / r["dir"], r["label"]) for r in suite["runs"]
                     if (p / r["dir"] / "metrics.jsonl").is_file()]  # a run not started yet has nothing to show
        else:
            runs.append(read_run(p))
    return runs


SUITE_RUN = ("label", "seed", "dir", "overrides")  # the fields of each of suite.json's runs


def read_suite(path: Path) -> dict:
    """A suite's suite.json: its preset, shared overrides and runs, each with SUITE_RUN's fields; anything else
    is a DamagedRunFile naming the file."""
    fix = "mend it, or move it away (a rerun of the suite writes it anew, listing the runs it is given)"
    suite = read_mapping(path, {"preset": str, "overrides": list, "runs": [dict]}, fix=fix)
    for i, r in enumerate(suite["runs"]):
        if sorted(r) != sorted(SUITE_RUN) or not isinstance(r["dir"], str) or not isinstance(r["label"], str):
            raise DamagedRunFile(f"{path}: runs[{i}] is {r}, not a run with {', '.join(SUITE_RUN)}; {fix}")
    return suite
