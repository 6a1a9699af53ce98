"""Benchmarks over checkpoints: each checkpoint's policy on every suite, one JSON per checkpoint.

    <out>/<checkpoint>.json             settings + per-benchmark metrics (+ by subject / level)
    <out>/<checkpoint>/<benchmark>.jsonl one record per problem: answers, rewards, the greedy text
    <out>/summary.md, <out>/accuracy.png every checkpoint result in the folder

`evaluate_checkpoint` judges whatever policy an engine serves now, so the trainer can call it at
its save points with its own engine; `evaluate_targets` loads checkpoints for `caspo eval`, which adds
its benchmarks to a checkpoint's JSON already in the folder when that was made with the same settings.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from caspo.config import Config, ConfigError, config_changes, describe_changes
from caspo.device_memory import limit_device_memory
from caspo.eval.benchmarks import HELDOUT, Suite, load_suites
from caspo.eval.report import FORMAT, group_table, plot_results, read_results, summary_table, write_markdown
from caspo.eval.suite import eval_samplers, evaluate_suite
from caspo.eval.targets import Target
from caspo.models.policy import load_policy, resolve_device, resolve_model_path
from caspo.models.tokenizer import load_tokenizer
from caspo.reward import VERIFIER_VERSION, RewardPool
from caspo.rollout.base import SamplingParams, publish
from caspo.rollout.factory import build_engine, engine_dtype, max_seq_len, sampling_params
from caspo.runlog import console, progress_bar


def settings(cfg: Config, run_sampling: SamplingParams) -> dict:
    """What the numbers depend on besides the weights."""
    s = eval_samplers(cfg, run_sampling)[1]
    r = cfg.reward
    return {"template": cfg.data.template, "max_prompt_tokens": cfg.data.max_prompt_tokens,
            "long_prompts": cfg.data.long_prompts,
            "max_new_tokens": cfg.eval.max_new_tokens, "limit": cfg.eval.limit, "samples": cfg.eval.samples,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop_strings),
            "backend": cfg.rollout.backend, "engine_dtype": str(engine_dtype(cfg)).removeprefix("torch."),
            "verifier": VERIFIER_VERSION,
            "reward": {"extractor": r.extractor, "fallback": r.fallback, "max_answer_chars": r.max_answer_chars},
            "seeds": "greedy: 0; sample s of problem i: sample_seed(0, -2**31, i, s)"}


def evaluate_checkpoint(engine, tokenizer, pool: RewardPool, cfg: Config, suites: list[Suite],
                        run_sampling: SamplingParams, *, checkpoint: str, step: int | None, policy: str,
                        out_dir: str | Path | None, progress=None, merge: bool = False) -> dict:
    """The engine's current policy on every suite; writes <out_dir>/<checkpoint>.json and the per-problem
    records, then refreshes summary.md and accuracy.png (out_dir None: writes nothing, as the ranks after the
    first of a run do). `run_sampling` is the run's sampler (its stop ids; caspo.eval.suite.eval_samplers).
    Pass a live rich `progress` to add its bars there. `merge`: an existing <checkpoint>.json keeps its other
    benchmarks, and one made with other settings is refused (without, it is replaced: a redone step's)."""
    out = Path(out_dir) if out_dir is not None else None
    result = {"format": FORMAT, "checkpoint": checkpoint, "step": step, "policy": policy,
              "settings": settings(cfg, run_sampling), "benchmarks": {}}
    if out is not None:
        if merge:
            result["benchmarks"] = earlier_benchmarks(out / f"{checkpoint}.json", result["settings"], policy)
        (out / checkpoint).mkdir(parents=True, exist_ok=True)
    with (nullcontext(progress) if progress is not None else progress_bar()) as bars:
        for suite in suites:
            total = len(suite.examples) * (1 + cfg.eval.samples)
            task = bars.add_task(f"{checkpoint} {suite.name}", total=total, status="")
            bench, records = evaluate_suite(engine, tokenizer, pool, cfg, suite, run_sampling,
                                            advance=lambda n, task=task: bars.advance(task, n))
            speed = bench["generation"]["tokens_per_s"] or 0.0
            bars.update(task, status=f"greedy {bench['metrics']['greedy']:.3f}, {speed:,.0f} tokens/s")
            result["benchmarks"][suite.name] = bench
            if out is not None:
                write_jsonl(out / checkpoint / f"{suite.name}.jsonl", records)
    if out is not None:
        write_json(out / f"{checkpoint}.json", result)
        refresh(out)
    return result


def earlier_benchmarks(path: Path, now: dict, policy: str) -> dict:
    """The benchmarks of an earlier result at `path` (none if absent), refused if made of another policy or
    with other settings."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    if not same_policy(earlier.get("policy", ""), policy):
        raise ConfigError(f"{path} holds results of {earlier.get('policy')}, not of {policy}; evaluate into another "
                          "--out, or remove it to replace it")
    changes = describe_changes(config_changes(earlier.get("settings", {}), now))
    if changes:
        raise ConfigError(f"{path} holds results made with other settings ({'; '.join(changes)}); evaluate into "
                          "another --out, or remove it to replace it")
    return earlier.get("benchmarks", {})


def same_policy(a: str, b: str) -> bool:
    """The same folder however it is written (runs/x, ./runs/x, /abs/runs/x), or the same name."""
    if Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def refresh(out_dir: str | Path) -> list[dict]:
    """summary.md and accuracy.png of every checkpoint result in the folder."""
    out = Path(out_dir)
    results = read_results(out)
    if results:
        write_markdown(results, out / "summary.md")
        plot_results(results, out / "accuracy.png")
    return results


def evaluate_targets(cfg: Config, targets: list[Target], out_dir: str | Path) -> list[dict]:
    """Load each target's policy into one engine (later ones are published into it) and evaluate it."""
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    device = resolve_device(cfg.model.device)
    limit_device_memory(device, cfg.model.device_memory_gib)
    tokenizer = load_tokenizer(resolve_model_path(targets[0].policy, targets[0].revision))
    suites = load_suites(cfg, tokenizer, cfg.eval.benchmarks or [HELDOUT])
    engine, results = None, []
    with RewardPool.from_config(cfg.reward) as pool, progress_bar() as bars:
        for version, target in enumerate(targets):
            policy = load_policy(resolve_model_path(target.policy, target.revision), device).eval()
            sampling = sampling_params(cfg, tokenizer, policy)
            if engine is None:
                engine = build_engine(cfg, policy, tokenizer, max_seq_len(cfg))
            else:
                publish(engine, policy, version)
            del policy
            results.append(evaluate_checkpoint(engine, tokenizer, pool, cfg, suites, sampling, checkpoint=target.name,
                                               step=target.step, policy=target.policy, out_dir=out_dir,
                                               progress=bars, merge=True))
    print_tables(results, read_results(out_dir))
    return results


def print_tables(latest: list[dict], everything: list[dict]) -> None:
    console.print(summary_table(everything, title="accuracy (every checkpoint in the folder)"))
    last = latest[-1]
    for name, bench in last["benchmarks"].items():
        for key in ("by_subject", "by_level"):
            if key in bench:
                console.print(group_table(name, last["checkpoint"], key.removeprefix("by_"), bench[key]))


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
