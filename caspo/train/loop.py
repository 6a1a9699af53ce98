"""The outer training step, phase by phase, as the data path of DESIGN.md:

    prompts  = cursor.take(P)                    resumable prompt cursor
    batch    = engine.generate(prompts × G)      t_roll    tokens + behaviour log-probs + policy version
    batch    = reward(batch)                     t_reward  verifier in a process pool
    batch    = old / ref log-probs               t_old, t_ref  (trainer recomputes, no grad)
    batch    = method_state.values(batch)        t_value   critic | Monte Carlo | prefix-model values
                                                           (a critic trained on its own first forward: its update)
    batch    = method.advantages(batch)          pure tensor functions of caspo.algo
    method_state.after_advantages(batch)         t_value_update  (CASPO online: one value-model step)
    stats    = update(batch, method.loss)        t_pol     the policy, then the method's learners
    engine.publish(policy, version + 1)          t_sync
    checkpoint / log / eval                      t_ckpt, t_eval
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Callable, Optional, Protocol

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config, ConfigError, to_yaml
from caspo.eval.benchmarks import load_suites
from caspo.models.policy import resolve_device
from caspo.precision import all_finite
from caspo.report.curves import plot_run
from caspo.report.timing import write_timing
from caspo.report.trackers import RunRecords, build_trackers, check_loggers
from caspo.rollout.base import Request
from caspo.rollout.sampling import sample_seed
from caspo.runlog import (
    JsonlWriter,
    StatusFile,
    console,
    device_name,
    machine_load,
    progress_bar,
    read_jsonl,
    record_end,
    record_start,
    run_start,
)
from caspo.train import distributed
from caspo.train.advantages import compute_advantages
from caspo.train.blocks import RankSplitEngine, RankSplitPool, logprobs
from caspo.train.health import HealthWatch, step_health, trailing_bad_steps
from caspo.train.health import check_config as check_health_config
from caspo.train.run_eval import evaluate, evaluate_benchmarks, missing_benchmarks_note, sampled_note, unevaluated
from caspo.train.run_files import RunStopped, load_during, prepare_run_dir
from caspo.train.scoring import score
from caspo.train.signals import StopRequest
from caspo.train.step_values import control_seed
from caspo.train.timers import PhaseTimer
from caspo.train.trainer import Trainer, build_trainer, publish_current, restore, save
from caspo.train.update import old_is_current, sleep_engine, update, wake_engine
from caspo.train.watchdog import Watchdog

__all__ = ["RunStopped", "Trainer", "build_trainer", "evaluate", "outer_step", "restore", "save", "score", "train"]


# ---------------------------------------------------------------- the outer step


def outer_step(tr: Trainer) -> tuple[RolloutBatch, dict]:
    cfg, timer, state = tr.cfg, PhaseTimer(tr.device), tr.method_state
    with timer("t_step"):
        indices = tr.cursor.take(cfg.rollout.prompts_per_step)
        with timer("t_roll"):
            batch = generate(tr, indices)
        with timer("t_reward"):
            batch.rewards = reward(tr, batch)
        with timer("t_old"):  # the proximal policy: recomputed by the trainer, unless asked to be the engine's
            if cfg.train.old_logprobs == "behaviour":
                batch.old_logprobs = batch.behaviour_logprobs.clone()
            elif old_is_current(cfg, tr.policy):  # ... or given by the update's own forward, when that is exact
                batch.old_is_current = True  # NaN until then: a reader before the update would show
                batch.old_logprobs = torch.full_like(batch.behaviour_logprobs, float("nan"))
            else:
                batch.old_logprobs = logprobs(tr.policy, batch, cfg)
        with timer("t_ref"):
            if tr.ref is not None:
                batch.ref_logprobs = logprobs(tr.ref, batch, cfg)
        with timer("t_value"):
            value_stats = state.values(tr, batch)
        batch.advantages, batch.returns = compute_advantages(batch, cfg, tr.method)
        with timer("t_value_update"):
            value_stats.update(state.after_advantages(tr, batch))
        with timer("t_pol"):
            sleep_engine(tr)  # its memory is the trainer's until the next rollout (unless the value phase took it)
            state.before_update(tr)
            stats = update(tr.actor, batch, cfg, tr.method, state, tr.update_rng, tr.scaler)
            tr.version += 1
        with timer("t_sync"):
            wake_engine(tr)
            publish_current(tr)
    tr.step += 1
    return batch, {**stats, **value_stats, **batch_stats(batch), **timer.reset()}


def generate(tr: Trainer, indices: list[int]) -> RolloutBatch:
    """G samples of each prompt; every sample's seed comes from (run seed, step, global prompt index, sample)."""
    cfg = tr.cfg
    G, P = cfg.rollout.samples_per_prompt, cfg.rollout.prompts_per_step
    prompts, seeds, groups, ids = [], [], [], []
    for i, item in enumerate(indices):
        global_prompt = tr.step * P + i
        for j in range(G):
            prompts.append(tr.data.train_prompts[item])
            seeds.append(sample_seed(cfg.train.seed, tr.step, global_prompt, j))
            groups.append(i)
            ids.append(tr.data.train[item].id)
    requests = [Request(p, s, cfg.rollout.max_new_tokens) for p, s in zip(prompts, seeds)]
    engine_stats = getattr(tr.engine, "stats", None)  # the native engine's counters
    before = dataclasses.replace(engine_stats) if engine_stats else None
    completions = RankSplitEngine(tr.engine, group=G).generate(requests, tr.sampling)  # by whole prompts
    texts = [tr.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
    labels = [tr.data.train[item].label for item in indices for _ in range(G)]
    batch = RolloutBatch.from_completions(prompts, completions, group_ids=groups, example_ids=ids,
                                          sample_seeds=seeds, texts=texts, pad_token_id=tr.tokenizer.pad_token_id,
                                          labels=labels)
    if before is not None:  # each wake drops the decode graphs: a rollout captures its shapes again
        during = engine_stats.since(before)  # the count every rank's, as the step's other counters; the time its own
        captures = int(distributed.all_sum({"captures": during.graph_captures})["captures"])
        batch.stats["rollout"] = {"roll_graph_captures": captures, "t_roll_capture": during.capture_s}
    return batch.to(tr.device)


def reward(tr: Trainer, batch: RolloutBatch) -> torch.Tensor:
    if tr.cfg.reward.synthetic:
        batch.stats["reward"] = {}
        return ((batch.responses * batch.response_mask.long()).sum(-1) % 2 == 0).float()
    result = RankSplitPool(tr.pool, group=tr.cfg.rollout.samples_per_prompt).score(
        batch.texts, batch.labels, batch.finished.tolist())  # each rank its own generated rows
    rewards = torch.tensor(result.rewards, dtype=torch.float32, device=tr.device)
    # the pool's counters; the slowest call and the largest worker are measurements (t_, mem_ keys)
    batch.stats["reward"] = {"reward_timeouts": result.timeouts, "reward_verifier_timeouts": result.verifier_timeouts,
                             "reward_crashes": result.crashes, "reward_over_budget": result.over_budget,
                             "reward_recycled": result.recycled,
                             "t_reward_max_call": result.max_call_s, "mem_reward_worker_peak_mb": result.max_rss_mb}
    if tr.cfg.reward.shuffle_within_batch:  # the control: same rewards, no longer tied to the samples
        g = torch.Generator().manual_seed(control_seed(tr.cfg, tr.step))
        batch.true_rewards = rewards
        rewards = rewards[torch.randperm(len(rewards), generator=g).to(tr.device)]
    return rewards


def batch_stats(batch: RolloutBatch) -> dict:
    lengths = batch.response_lengths.float()
    stats = {
        "reward_mean": float(batch.rewards.mean()),
        "response_len_mean": float(lengths.mean()),
        "truncated_frac": float((~batch.finished).float().mean()),
        "reward_timeouts": 0, "reward_verifier_timeouts": 0, "reward_crashes": 0, "reward_over_budget": 0,
        "reward_recycled": 0,
        **batch.stats.get("reward", {}),
        **batch.stats.get("rollout", {}),
        "behaviour_vs_old_logp_absdiff": float(
            algo.masked_mean((batch.behaviour_logprobs - batch.old_logprobs).abs(), batch.response_mask)),
    }
    if batch.true_rewards is not None:
        stats["true_reward_mean"] = float(batch.true_rewards.mean())
    return stats


def sample_records(tr: Trainer, batch: RolloutBatch, step: int) -> list[dict]:
    rewards = (batch.true_rewards if batch.true_rewards is not None else batch.rewards).tolist()
    lengths = batch.response_lengths.tolist()
    tokens = batch.responses.tolist()
    return [
        {"step": step, "prompt_id": batch.example_ids[i], "sample_seed": batch.sample_seeds[i],
         "tokens_digest": hashlib.sha256(str(tokens[i][:lengths[i]]).encode()).hexdigest()[:16],
         "policy_version": batch.policy_versions[i], "finish_reason": batch.finish_reasons[i],
         "length": int(batch.response_lengths[i]), "reward": rewards[i], "text": batch.texts[i]}
        for i in range(batch.size)
    ]


# ---------------------------------------------------------------- the run


class BetweenSegments(Protocol):
    """What runs between two segments of a run: CASPO's refresh (`caspo.value.refresh.Refresh`)."""

    def before_first(self, cfg: Config) -> Config:
        """The config the run starts with, once its folder is ready (CASPO's phase 0: a first value model)."""

    def due(self, step: int) -> bool: ...

    def record_at(self, step: int) -> Callable[[dict], bool]: ...

    def __call__(self, tr: Trainer, checkpoint) -> dict: ...


class NoRefresh:
    def before_first(self, cfg: Config) -> Config:
        return cfg

    def due(self, step: int) -> bool:
        return False


def train(cfg: Config, resume: str | None = None, refresh: Optional[BetweenSegments] = None,
          overwrite: bool = False) -> dict:
    """The run: evaluation before, outer steps with checkpoints, logs and evaluation, evaluation after.
    `refresh` runs between segments; a config with method.caspo.refresh_every needs one. SIGTERM or
    Ctrl-C end the run after the current step, with a checkpoint to resume from; so does a train.health
    detector set to stop (raising RunStopped). run.json records what the run ran on, status.json its state."""
    # a rank of several joins the others (caspo.train.distributed); else nothing
    cfg = distributed.start(cfg)
    if cfg.method.caspo.refresh_every and refresh is None:
        raise ConfigError("method.caspo.refresh_every needs the refresh pipeline: run `caspo train`, or pass "
                          "refresh=caspo.value.refresh.Refresh(cfg) to train()")
    check_loggers(cfg)
    check_health_config(cfg.train.health)
    refresh = refresh or NoRefresh()
    # the newest checkpoint: a refresh resumes from it (rank 0 prepares the folder for every rank)
    checkpoint = distributed.on_main(prepare_run_dir, cfg, resume, overwrite)
    cfg = refresh.before_first(cfg)
    device = resolve_device(cfg.model.device)
    cuda_index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
    load = machine_load(cuda_index)  # before the trainer takes the machine
    tr = build_trainer(cfg)
    changes = []  # settings this config changes from the checkpoint's: said, and kept in run.json
    if checkpoint is not None:  # a refused or failed resume leaves the run's files (its config.yaml) as they were
        changes = restore(tr, checkpoint)
        if tr.step > cfg.train.steps:  # equal: nothing left to train, but the run ends (its final evaluation)
            raise ConfigError(f"the checkpoint is at step {tr.step}; set train.steps >= {tr.step} (it is "
                              f"{cfg.train.steps})")
    tr.run_dir.mkdir(parents=True, exist_ok=True)
    (tr.run_dir / "config.yaml").write_text(to_yaml(cfg))
    if checkpoint is not None:
        console.print(f"resumed from {checkpoint} at step {tr.step}, policy version {tr.version}")
        if changes:
            console.print(f"[yellow]settings changed from the checkpoint's:[/] {'; '.join(changes)}")
    engine_dtype = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else cfg.train.precision  # auto: its compute dtype
    start = run_start(step=tr.step, device=str(tr.device), device_name=device_name(tr.device),
                      precision=cfg.train.precision, engine_dtype=engine_dtype, load=load)
    start["data"] = tr.data.summary  # what was loaded: sources, counts, rows left out and why
    run_record = record_start(tr.run_dir, {**start, "config_changes": changes} if changes else start,
                              resumed=resume is not None)
    status = StatusFile(tr.run_dir / "status.json", cfg.train.steps)
    status.update(step=tr.step)
    truncate = tr.step if resume else -1
    # a run resumed at a refresh step does that refresh again (reusing what it finds) and logs it again
    redo = refresh.record_at(tr.step) if resume and refresh.due(tr.step) else None
    jsonl = JsonlWriter(tr.run_dir / "metrics.jsonl", truncate_after_step=truncate, drop=redo)
    watch = HealthWatch(cfg, [r for r in read_jsonl(jsonl.path) if "reward_mean" in r])
    metrics = RunRecords(jsonl, build_trackers(cfg, tr.run_dir, tr.step if resume else 0,
                                               run_record["starts"][0]["started_at"]))
    samples = JsonlWriter(tr.run_dir / "samples.jsonl", truncate_after_step=truncate)
    loads: list[float] = []  # the 1-minute load average after every step of this process
    try:
        summary = run_steps(tr, cfg, refresh, checkpoint, metrics, samples, watch, status, loads)
    except BaseException as err:
        state = "stopped" if isinstance(err, RunStopped) else "failed"
        status.update(state=state, message=str(err) or type(err).__name__)
        record_end(tr.run_dir, run_record, state=state, step=tr.step, **load_during(loads))
        write_timing(tr.run_dir)
        if isinstance(err, RunStopped) and cfg.train.curves:
            plot_run(tr.run_dir)
        raise
    finally:
        metrics.close()
        samples.close()
    if cfg.train.curves:
        summary["curves"] = str(plot_run(tr.run_dir))
    finished = tr.step == cfg.train.steps
    status.update(state="finished" if finished else "stopped", step=tr.step,
                  message="" if finished else f"stopped after step {tr.step} of {cfg.train.steps} "
                                              f"({summary.get('stopped_by', 'train.stop_after')}); continue with "
                                              "--resume latest")
    record_end(tr.run_dir, run_record, state="finished" if finished else "stopped", step=tr.step,
               **load_during(loads))
    summary["timing"] = str(write_timing(tr.run_dir))
    return summary


def batch_histograms(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The step's token advantages, the update's ratios π/π_old (each token's at its last training forward,
    the ratio the loss clips), and the ratio π_old/μ of the trainer's recomputed scores to the engine's."""
    mask = batch.response_mask.bool()
    out = {}
    if batch.advantages is not None:
        out["advantages"] = batch.advantages[mask]
    if batch.update_ratios is not None:
        out["update_ratio"] = batch.update_ratios[mask]
    if batch.old_logprobs is not None:
        ratio = (batch.old_logprobs - batch.behaviour_logprobs)[mask].exp()
        out["old_over_behaviour_ratio"] = ratio[torch.isfinite(ratio)]
    return out


def weights_finite(tr: Trainer) -> bool:
    finite = all_finite(tr.policy.parameters())  # this rank's shards
    return not distributed.any_rank(not finite)


def health_stop(tr: Trainer, stops: list, checkpoint) -> RunStopped:
    reasons = "\n".join(f"train.health.{a.detector}: {a.message}" for a in stops)
    return RunStopped(f"the run stopped itself after step {tr.step}:\n{reasons}\nIts checkpoint: "
                      f"{checkpoint or 'none (no save yet)'}; once fixed, continue with --resume latest")


def run_steps(tr: Trainer, cfg: Config, refresh, checkpoint, metrics: RunRecords, samples: JsonlWriter,
              watch: HealthWatch, status: StatusFile, loads: list[float]) -> dict:
    summary: dict = {"run_dir": str(tr.run_dir)}
    last = min(cfg.train.steps, tr.step + cfg.train.stop_after) if cfg.train.stop_after else cfg.train.steps
    bad_steps = trailing_bad_steps(watch.history)  # outer steps in a row with an update skipped (non-finite)
    with tr.pool, StopRequest() as stop, Watchdog(status, cfg.train.health.watchdog_s) as watchdog:
        suites = load_suites(cfg, tr.tokenizer, cfg.eval.benchmarks) if cfg.eval.benchmarks else []
        missing = unevaluated(tr.run_dir, suites) if suites and distributed.is_main() else []
        if missing:  # a resumed run does not go back to them
            console.print(missing_benchmarks_note(tr.run_dir, missing))
        if cfg.eval.before and tr.step == 0:
            timer = PhaseTimer()
            with timer("t_eval"):
                before = evaluate(tr)
                if suites:
                    before |= evaluate_benchmarks(tr, suites, "base", cfg.model.policy)
            metrics.write({"step": 0, **before, **timer.reset()})
            summary["before"] = before
            console.print(f"held-out greedy before: accuracy {before['eval_accuracy']:.3f}, "
                          f"boxed {before['eval_boxed_rate']:.3f} (n={before['eval_n']}){sampled_note(before)}")
        train_time = 0.0
        with progress_bar() as progress:
            task = progress.add_task("train", total=cfg.train.steps, completed=tr.step, status="")
            while tr.step < last:
                if refresh.due(tr.step):  # caspo: a fresh value model for the next segment
                    progress.stop()  # the refresh shows its own progress bars
                    metrics.write(refresh(tr, checkpoint))
                    progress.start()
                skipped_before = tr.scaler.skipped_steps
                if tr.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(tr.device)
                batch, stats = outer_step(tr)
                stats |= step_health(tr, batch, stats)
                bad_steps = bad_steps + 1 if tr.scaler.skipped_steps > skipped_before else 0
                if cfg.train.max_bad_steps and bad_steps >= cfg.train.max_bad_steps:
                    metrics.write({"step": tr.step, **stats})
                    raise RunStopped(
                        f"{bad_steps} outer steps in a row skipped an update for non-finite gradients (up to step "
                        f"{tr.step}); the last good checkpoint is {checkpoint or 'none (no save yet)'}. Lower "
                        "optim.lr, use train.precision=bf16 or fp32, or raise train.max_bad_steps")
                train_time += stats["t_step"]
                record = {"step": tr.step, **stats}
                alarms = distributed.from_main(watch.check(dict(record)))  # rank 0 decides for all ranks
                requested = distributed.from_main(stop.requested)
                stops = [a for a in alarms if a.action == "stop"]
                for a in alarms:
                    console.print(f"[{'red' if a in stops else 'yellow'}]health ({a.detector}, step {tr.step}): "
                                  f"{a.message}[/]")
                if alarms:
                    record["health"] = [a.detector for a in alarms]
                timer = PhaseTimer()
                at_last = tr.step == last and (cfg.train.save_last or last < cfg.train.steps)
                if cfg.train.save_every and tr.step % cfg.train.save_every == 0 or at_last \
                        or refresh.due(tr.step) or requested or stops:
                    if not stops or weights_finite(tr):  # never a checkpoint of non-finite weights
                        with timer("t_ckpt"):
                            checkpoint = save(tr)
                    if suites and not requested and not stops:  # every checkpoint's benchmarks
                        with timer("t_bench"):
                            record |= evaluate_benchmarks(tr, suites, checkpoint.name, str(checkpoint / "policy"),
                                                          progress)
                    elif suites and checkpoint is not None:  # stopping: no time for them
                        console.print(missing_benchmarks_note(tr.run_dir, [checkpoint.name]))
                final = cfg.eval.after and tr.step == cfg.train.steps  # evaluated once, below
                if cfg.eval.every and tr.step % cfg.eval.every == 0 and not final and not stops:
                    with timer("t_eval"):
                        record.update(evaluate(tr))
                record.update(timer.reset())
                metrics.write(record)
                step_samples = sample_records(tr, batch, tr.step)
                for s in step_samples:
                    samples.write(s)
                if metrics.trackers:
                    metrics.batch(tr.step, step_samples[:cfg.train.log_samples], batch_histograms(batch))
                if hasattr(os, "getloadavg"):
                    loads.append(os.getloadavg()[0])
                watchdog.beat(tr.step)
                progress.update(task, completed=tr.step,
                                status=f"reward {stats['reward_mean']:.3f}  step {stats['t_step']:.1f}s")
                if stops:
                    raise health_stop(tr, stops, checkpoint)
                if requested:
                    console.print(f"{requested}: stopped after step {tr.step} with checkpoint {checkpoint}; "
                                  "continue with --resume latest")
                    summary["stopped_by"] = requested
                    break
        summary["train_seconds"] = round(train_time, 1)
        if cfg.eval.after and tr.step == cfg.train.steps:
            timer = PhaseTimer()
            with timer("t_eval"):
                after = evaluate(tr)
            metrics.write({"step": tr.step, **after, **timer.reset()})
            summary["after"] = after
            console.print(f"held-out greedy after {tr.step} steps: accuracy {after['eval_accuracy']:.3f}, "
                          f"boxed {after['eval_boxed_rate']:.3f}{sampled_note(after)}")
    return summary
