"""Issue 18's speed and memory targets on one card: run the benchmarks that measure them, then check the figures.

`run PART` runs one benchmark with the flags that benchmarks/RESULTS.md records for its targets and appends its JSON
lines to --out; `report FILE` reads those lines and prints every target with its figure, the card and commit that
gave it, and whether it holds. Each part takes under ten minutes on an H100 or H200:

    python benchmarks/seed_targets.py run grpo-32 --out targets.jsonl         # 32 × 8 × 1,024 grpo          ~2 min
    python benchmarks/seed_targets.py run methods-64 --out targets.jsonl      # 64 × 8 grpo and ppo_critic   ~4 min
    python benchmarks/seed_targets.py run step-values-64 --out targets.jsonl  # 64 × 8 caspo and vineppo     ~8 min
    python benchmarks/seed_targets.py run seed-shape --out targets.jsonl      # 128 × 8, responses to 2,048  ~8 min
    python benchmarks/seed_targets.py run rollout --out targets.jsonl         # top-p 0.9 and 1.0            ~2 min
    python benchmarks/seed_targets.py report targets.jsonl [--markdown targets.md]

The KV cache is sized in GiB and passed as the card's share of it, so an 80 GB and a 141 GB card run the same cache.
Each method's default (KV_GIB) fits an 80 GB card: 11 GiB holds a whole 32 × 8 × 1,024 rollout; 14 fits beside
ppo_critic's policy, critic, reference and optimizers at 64 × 8 (15.5 GiB were left there); 16 holds caspo's 64 × 8
rollout; vineppo's 36 is the most an 80 GB card leaves its continuations (peak 74.4 GiB allocated, 76.0 reserved on an
H100), about 930 of them at once. --kv-gib sets every method's cache; 42 gives an H200 its default share of 0.3. The
seed's shape runs under `model.device_memory_gib=76` on any card, at the preset's own KV share of that cap. A run's
first step compiles and captures graphs, so step times and MFU are the worst of the steps after it; peaks are the
largest of all steps. MFU is a share of 790 TFLOP/s, the dense bf16 GEMM rate measured on these cards, which
issue 18's target is stated against; the report's note gives its share of the datasheet peak (989 on H100/H200
SXM). A ratio divides the last steps of two methods measured on the same card. The 64 × 8 runs plant line steps and
EOS in the random policy, as RESULTS.md's do: its responses then have about five steps and 430 of their 1,024
tokens. Every part runs under caspo's allocator, expandable segments (caspo/allocator.py), unless
PYTORCH_CUDA_ALLOC_CONF says otherwise; each record names the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from _common import DATASHEET_TFLOPS, GEMM_TFLOPS, append_result, print_table

import caspo.allocator  # noqa: F401  (the parts' processes inherit caspo's allocator setting)

HERE = Path(__file__).resolve().parent
SMOKE = [sys.executable, str(HERE / "trainer_smoke.py")]
COMPILED = ["--micro-tokens", "16384", "--set", "train.compile=true"]
PLANTED = ["--newline-rate", "0.01", "--eos-rate", "0.002",
           "--set", "method.kl_coef=0.001", "--set", "reward.workers=8"]
SEED_CAP_GIB = 76  # the seed's 80 GB card, less what the driver and the CUDA context hold
SEED_RUN = ["qwen-math-dsr", "train.compile=true", "train.steps=2", "train.save_every=0", "train.save_last=false",
            "eval.before=false", "eval.after=false", "eval.benchmarks=[]", f"model.device_memory_gib={SEED_CAP_GIB}"]
ROLLOUT_SHAPE = {"prompts": 256, "samples": 1, "prompt_len": 128, "new_tokens": 512, "temperature": 0.6,
                 "logit_scale": 1.0}


# ---------------------------------------------------------------- run: the benchmarks behind the targets

def part_commands(part: str, card_gib: float, out: str, commit: str, kv_gib: float = 0.0) -> list[list[str]]:
    """The benchmark command lines of a part (seed-shape is `run_seed_shape`): each method's KV cache is `kv_gib`,
    or its default in KV_GIB, passed as its share of the card's `card_gib`."""
    def smoke(methods: str, *flags: str) -> list[str]:
        gib = kv_gib or KV_GIB[methods]
        if not 0 < gib < card_gib:
            raise SystemExit(f"a KV cache of {gib} GiB does not fit this card's {card_gib:.1f} GiB; pass --kv-gib")
        return [*SMOKE, "--methods", methods, *flags, "--gpu-memory-fraction", f"{gib / card_gib:.4f}",
                "--out", out, "--commit", commit]

    if part == "grpo-32":
        return [smoke("grpo", "--steps", "4", *COMPILED)]
    if part == "methods-64":
        return [smoke("grpo,ppo_critic", "--prompts", "64", "--steps", "3", *COMPILED, *PLANTED)]
    if part == "step-values-64":  # one process a method: each with its own cache
        return [smoke(method, "--prompts", "64", "--steps", "2", *COMPILED, *PLANTED,
                      "--set", "rollout.shared_prefix_attention=true") for method in ("caspo", "vineppo")]
    if part == "rollout":
        return [[sys.executable, str(HERE / "rollout_throughput.py"), "--engines", "native-graphs", "--top-p", top_p,
                 "--out", out, "--commit", commit] for top_p in ("0.9", "1.0")]
    raise ValueError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")


def run_seed_shape(out: str, commit: str, card: str) -> None:
    """grpo at the seed's shape (`qwen-math-dsr` on benchmarks/standin.py's random Qwen2.5-Math-1.5B), two steps
    under the 76 GiB cap; one record of its steps, or of its exit status where it failed."""
    with tempfile.TemporaryDirectory(prefix="caspo-seed-") as work:
        policy, run_dir = Path(work) / "standin", Path(work) / "run"
        # each in its own process: the run has the card to itself
        subprocess.run([sys.executable, str(HERE / "standin.py"), "--out", str(policy), "--device", "cuda"], check=True)
        status = subprocess.run([sys.executable, "-m", "caspo.cli", "train", *SEED_RUN, f"model.policy={policy}",
                                 f"train.output_dir={run_dir}"]).returncode
        metrics = run_dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
    steps = [s for s in map(json.loads, lines) if "t_step" in s]
    append_result(out, {"benchmark": "seed_shape", **run_environment(card, commit), "cap_gib": SEED_CAP_GIB,
                        "returncode": status, "steps": steps})


def run_environment(card: str, commit: str) -> dict:
    import torch

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "card": card,
            "torch": torch.__version__, "commit": commit, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


PARTS = ("grpo-32", "methods-64", "step-values-64", "seed-shape", "rollout")
KV_GIB = {"grpo": 11.0, "grpo,ppo_critic": 14.0, "caspo": 16.0, "vineppo": 36.0}  # by the methods of a run


# ---------------------------------------------------------------- report: each target against its figure

@dataclass(frozen=True)
class Figure:
    value: float
    card: str
    commit: str
    note: str = ""


@dataclass(frozen=True)
class Target:
    name: str
    bound: float
    unit: str
    at_most: bool  # the figure must be ≤ bound (else ≥)
    measure: Callable[[list[dict]], Figure | None]


def latest_smoke(records: list[dict], method: str, prompts: int) -> dict | None:
    """The last trainer_smoke record of `method` at prompts × 8 × 1,024 on one CUDA process."""
    found = [r for r in records if r.get("benchmark") == "trainer_smoke" and r.get("method") == method
             and r["shape"]["prompts"] == prompts and r["shape"]["samples"] == 8 and r["shape"]["new_tokens"] == 1024
             and r.get("knobs", {}).get("nproc", 1) == 1 and r.get("steps") and "mem_peak_gb" in r["steps"][0]]
    return found[-1] if found else None


def after_first(steps: list[dict]) -> list[dict]:
    """The steady steps: all but the first (which compiles and captures), or the one there is."""
    return steps[1:] or steps


def smoke_figure(method: str, prompts: int, read: Callable[[list[dict]], float]) -> Callable:
    def measure(records: list[dict]) -> Figure | None:
        record = latest_smoke(records, method, prompts)
        if record is None:
            return None
        share = record.get("knobs", {}).get("kv_share")
        return Figure(read(record["steps"]), record["card"], record["commit"],
                      f"{len(record['steps'])} steps" + (f", KV share {share:.3f}" if share is not None else ""))
    return measure


def mfu_figure(method: str, prompts: int) -> Callable:
    """The policy MFU of the steady steps, as a share of the measured GEMM rate the record names (records made
    before it named one used the default, 790); the note gives its share of the datasheet peak."""
    def measure(records: list[dict]) -> Figure | None:
        record = latest_smoke(records, method, prompts)
        if record is None:
            return None
        mfu = min(s["policy_mfu"] for s in after_first(record["steps"]))
        reference = record.get("mfu_reference", {})
        gemm = reference.get("measured_gemm_tflops", GEMM_TFLOPS)
        datasheet = reference.get("datasheet_tflops", DATASHEET_TFLOPS)
        return Figure(mfu, record["card"], record["commit"],
                      f"of {gemm:g} TFLOP/s, the measured bf16 GEMM rate; {mfu * gemm / datasheet:.0%} of the "
                      f"{datasheet:g} TFLOP/s datasheet peak")
    return measure


def ratio_figure(method: str, base: str) -> Callable:
    """`method`'s last step over `base`'s at 64 × 8, on the same card."""
    def measure(records: list[dict]) -> Figure | None:
        top, bottom = latest_smoke(records, method, 64), latest_smoke(records, base, 64)
        if top is None or bottom is None:
            return None
        if top["card"] != bottom["card"]:
            return Figure(float("nan"), f"{top['card']} / {bottom['card']}", "",
                          "not comparable: measured on different cards")
        t, b = top["steps"][-1]["t_step"], bottom["steps"][-1]["t_step"]
        commits = top["commit"] if top["commit"] == bottom["commit"] else f"{top['commit']} / {bottom['commit']}"
        shares = [r.get("knobs", {}).get("kv_share") for r in (top, bottom)]  # each method's own cache
        caches = f", KV share {shares[0]:.3f} / {shares[1]:.3f}" if None not in shares else ""
        return Figure(t / b, top["card"], commits, f"{t:.1f} s / {b:.1f} s{caches}")
    return measure


def seed_figure(records: list[dict]) -> Figure | None:
    found = [r for r in records if r.get("benchmark") == "seed_shape"]
    if not found:
        return None
    record = found[-1]
    if record["returncode"] != 0 or not record["steps"]:
        return Figure(float("nan"), record["card"], record["commit"],
                      f"failed (exit status {record['returncode']}) after {len(record['steps'])} steps")
    steps = record["steps"]
    times = ", ".join(f"{s['t_step']:.1f}" for s in steps)
    retries = sum(s.get("mem_alloc_retries", 0) for s in steps)  # at the cap: the allocator freed its cache and retried
    allocator = f", PYTORCH_CUDA_ALLOC_CONF={record['allocator']}" if record.get("allocator") else ""
    return Figure(max(s["mem_peak_reserved_gb"] for s in steps), record["card"], record["commit"],
                  f"steps of {times} s under a {record['cap_gib']} GiB cap, {retries} allocator retries{allocator}")


def rollout_figure(top_p: float) -> Callable:
    def measure(records: list[dict]) -> Figure | None:
        found = [r for r in records if r.get("benchmark") == "rollout_throughput"
                 and all(r["shape"].get(k) == v for k, v in {**ROLLOUT_SHAPE, "top_p": top_p}.items())
                 and "native-graphs" in r["engines"]]
        if not found:
            return None
        result = found[-1]["engines"]["native-graphs"]
        return Figure(result["tokens_per_s"], found[-1]["card"], found[-1]["commit"],
                      f"decode alone {result['decode_tokens_per_s']:,.0f}" if "decode_tokens_per_s" in result else "")
    return measure


TARGETS = (
    Target("32 × 8 grpo: step", 15.0, "s", True,
           smoke_figure("grpo", 32, lambda steps: max(s["t_step"] for s in after_first(steps)))),
    Target("32 × 8 grpo: peak allocated", 48.0, "GiB", True,
           smoke_figure("grpo", 32, lambda steps: max(s["mem_peak_gb"] for s in steps))),
    Target("32 × 8 grpo: policy MFU", 0.50, "", False, mfu_figure("grpo", 32)),
    Target("64 × 8 grpo: step", 22.0, "s", True,
           smoke_figure("grpo", 64, lambda steps: max(s["t_step"] for s in after_first(steps)))),
    Target("64 × 8 ppo_critic / grpo", 1.5, "×", True, ratio_figure("ppo_critic", "grpo")),
    Target("64 × 8 caspo / grpo", 1.3, "×", True, ratio_figure("caspo", "grpo")),
    Target("64 × 8 vineppo / caspo", 2.5, "×", True, ratio_figure("vineppo", "caspo")),
    Target("seed's shape: peak reserved", float(SEED_CAP_GIB), "GiB", True, seed_figure),
    Target("rollout top-p 0.9", 60_000, "tokens/s", False, rollout_figure(0.9)),
    Target("rollout top-p 1.0", 80_000, "tokens/s", False, rollout_figure(1.0)),
)


def verdict(target: Target, figure: Figure | None) -> str:
    if figure is None:
        return "not measured"
    if figure.value != figure.value:  # nan: a failed or incomparable measurement
        return "no figure"
    held = figure.value <= target.bound if target.at_most else figure.value >= target.bound
    return "met" if held else "missed"


def formatted(value: float, unit: str) -> str:
    if value != value:
        return "-"
    if unit == "":
        return f"{value:.0%}"
    if unit == "tokens/s":
        return f"{value:,.0f}"
    return f"{value:.2f}" if unit == "×" else f"{value:.1f}"


def report_rows(records: list[dict]) -> list[list[str]]:
    """One row per target: the target, its bound, the figure, the verdict, the card, the commit and a note."""
    rows = []
    for target in TARGETS:
        figure = target.measure(records)
        bound = ("≤ " if target.at_most else "≥ ") + formatted(target.bound, target.unit) + (
            f" {target.unit}" if target.unit else "")
        rows.append([target.name, bound, formatted(figure.value, target.unit) if figure else "-",
                     verdict(target, figure), figure.card if figure else "", figure.commit if figure else "",
                     figure.note if figure else ""])
    return rows


HEADER = ["target", "bound", "figure", "verdict", "card", "commit", "note"]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


# ---------------------------------------------------------------- the command line

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one part's benchmarks")
    run.add_argument("part", choices=PARTS)
    run.add_argument("--out", required=True, help="append the results as JSON lines to this file")
    run.add_argument("--commit", default="", help="the code's commit (default: git's, where this is a checkout)")
    run.add_argument("--kv-gib", type=float, default=0.0,
                     help="the KV cache in GiB of every method of the 32 × 8 and 64 × 8 parts (default: KV_GIB's)")
    report = sub.add_parser("report", help="each target against the figures in a results file")
    report.add_argument("results")
    report.add_argument("--markdown", default="", help="also write the table to this file as Markdown")
    args = parser.parse_args()

    if args.command == "report":
        path = Path(args.results)
        if not path.exists():
            raise SystemExit(f"{path}: no such results file; `seed_targets.py run PART --out {path}` writes it")
        rows = report_rows(read_records(path))
        print_table(HEADER, rows)
        if args.markdown:
            Path(args.markdown).write_text(markdown(rows))
        return

    commit = args.commit or git_commit()
    card, total_gib = card_and_memory()
    if args.part == "seed-shape":
        run_seed_shape(args.out, commit, card)
        return
    for command in part_commands(args.part, total_gib, args.out, commit, args.kv_gib):
        status = subprocess.run(command).returncode
        if status:  # a benchmark appends each finished run, so what finished before the failure is kept
            raise SystemExit(f"{args.part}: {Path(command[1]).name} exited with status {status}; what finished "
                             f"is in {args.out}")


def card_and_memory() -> tuple[str, float]:
    """The card's name and GiB, read by a child process, so that this one holds no CUDA context beside the runs."""
    query = "import torch; print(torch.cuda.get_device_name()); print(torch.cuda.mem_get_info()[1])"
    found = subprocess.run([sys.executable, "-c", f"import torch; assert torch.cuda.is_available(); {query}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit("the targets are for one CUDA card, and none is visible here")
    name, total = found.stdout.strip().splitlines()[-2:]
    return name, int(total) / 2**30


def read_records(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise SystemExit(f"{path}:{number}: not a JSON line ({error.msg}); remove or mend that line")
    return records


def git_commit() -> str:
    found = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else "unknown"


if __name__ == "__main__":
    main()
