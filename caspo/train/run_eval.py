"""What a run evaluates: the held-out set (greedy, and avg@k at the run's sampler) and, at every checkpoint,
eval.benchmarks written as `caspo eval` writes them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from caspo.eval.heldout import greedy_accuracy, sampled_accuracy
from caspo.eval.run import evaluate_checkpoint
from caspo.eval.suite import eval_samplers
from caspo.eval.targets import checkpoint_dirs
from caspo.rollout.base import publish
from caspo.train import distributed
from caspo.train.blocks import evaluation_engine_and_pool
from caspo.train.trainer import Trainer, publish_current


@contextmanager
def serving_the_current_policy(tr: Trainer):
    """The engine serves the policy the run holds now while inside; with rollout.staleness it serves an older
    version for rollouts, and does again after."""
    if tr.cfg.rollout.staleness:
        publish(tr.engine, tr.policy, tr.version)
    try:
        yield
    finally:
        if tr.cfg.rollout.staleness:
            publish_current(tr)


def evaluate(tr: Trainer) -> dict:
    """The held-out set's metrics of the policy the run holds now; with several processes each rank generates
    and scores its block of it."""
    with serving_the_current_policy(tr):
        return held_out_metrics(tr)


def held_out_metrics(tr: Trainer) -> dict:
    cfg = tr.cfg
    engine, pool = evaluation_engine_and_pool(tr)
    result = greedy_accuracy(engine, tr.tokenizer, tr.data.eval_prompts, [e.label for e in tr.data.eval],
                             pool, max_new_tokens=cfg.eval.max_new_tokens,
                             stop_token_ids=tr.sampling.stop_token_ids, stop_strings=cfg.rollout.stop)
    metrics = {f"eval_{k}": v for k, v in result.summary().items()}
    if cfg.eval.samples:
        sampled = sampled_accuracy(engine, tr.tokenizer, tr.data.eval_prompts, [e.label for e in tr.data.eval],
                                   pool, samples=cfg.eval.samples, sampling=eval_samplers(cfg, tr.sampling)[1],
                                   max_new_tokens=cfg.eval.max_new_tokens)
        metrics |= {f"eval_sampled_{k}": v for k, v in sampled.summary().items()}
    return metrics


def sampled_note(metrics: dict) -> str:
    return f"; sampled avg@k {metrics['eval_sampled_accuracy']:.3f}" if "eval_sampled_accuracy" in metrics else ""


def evaluate_benchmarks(tr: Trainer, suites: list, checkpoint: str, policy: str, progress=None) -> dict:
    """eval.benchmarks on the policy the run holds now, written as `caspo eval` writes them
    (<run>/eval/<checkpoint>.json); returns each benchmark's greedy accuracy for the run log. With several
    processes each rank generates and scores its block of every benchmark, and rank 0 writes them."""
    engine, pool = evaluation_engine_and_pool(tr)
    with serving_the_current_policy(tr):  # the one just saved
        result = evaluate_checkpoint(engine, tr.tokenizer, pool, tr.cfg, suites, tr.sampling,
                                     checkpoint=checkpoint, step=tr.step, policy=policy,
                                     out_dir=tr.run_dir / "eval" if distributed.is_main() else None,
                                     progress=progress)
    return {f"bench_{name}_greedy": bench["metrics"]["greedy"] for name, bench in result["benchmarks"].items()}




def unevaluated(run_dir: Path, suites: list) -> list[str]:
    """The run's checkpoints whose result lacks one of `suites`: a stop request, or a crash during their
    evaluation, saved them without it, and nothing later goes back."""
    missing = []
    for ckpt in checkpoint_dirs(run_dir) if (run_dir / "checkpoints").is_dir() else []:
        result = run_dir / "eval" / f"{ckpt.name}.json"
        have = json.loads(result.read_text()).get("benchmarks", {}) if result.is_file() else {}
        if any(suite.name not in have for suite in suites):
            missing.append(ckpt.name)
    return missing


def missing_benchmarks_note(run_dir: Path, names: list[str]) -> str:
    return (f"[yellow]{', '.join(names)} saved without eval.benchmarks' results: `caspo eval {run_dir} "
            f"--checkpoints {','.join(names)} --out {run_dir / 'eval'}` evaluates them into the run's results[/]")
