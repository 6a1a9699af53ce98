"""The checks a loaded config must pass before any method row is looked at: the shapes that must
agree (whole minibatches, ...) and the ranges of single values. `caspo.methods.resolve_method`
adds the checks a method's row brings (G >= 2 for GRPO, ...)."""

from __future__ import annotations

from caspo.config.schema import Config, ConfigError, EvalConfig, MethodConfig, RewardConfig


def validate(cfg: Config) -> None:
    """Checks that need no method row; `caspo.methods.resolve_method` adds the method's own."""
    r, t, m = cfg.rollout, cfg.train, cfg.method
    positive = {
        "rollout.prompts_per_step": r.prompts_per_step,
        "rollout.samples_per_prompt": r.samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "train.minibatch_size": t.minibatch_size,
        "train.micro_batch_size": t.micro_batch_size,
        "train.epochs_per_rollout": t.epochs_per_rollout,
        "train.steps": t.steps,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    n = cfg.responses_per_step
    if n % t.minibatch_size:
        raise ConfigError(
            f"train.minibatch_size={t.minibatch_size} does not divide the {n} responses of a step "
            f"(rollout.prompts_per_step × rollout.samples_per_prompt = {r.prompts_per_step} × {r.samples_per_prompt}); "
            "choose a divisor so every minibatch is whole"
        )
    if t.minibatch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} does not divide train.minibatch_size={t.minibatch_size}"
        )
    validate_reward(cfg.reward)
    validate_refresh(m)
    validate_data(cfg)
    if r.cuda_graphs and r.backend != "native":
        raise ConfigError("rollout.cuda_graphs=true needs rollout.backend=native")
    if r.staleness < 0:
        raise ConfigError(f"rollout.staleness must be >= 0, got {r.staleness}")
    if not 0.0 <= cfg.sft.slip_prob <= 1.0:
        raise ConfigError(f"sft.slip_prob must be in [0, 1], got {cfg.sft.slip_prob}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0 for training rollouts, got {r.temperature}")
    if m.clip_low < 0 or m.clip_high < 0:
        raise ConfigError("method.clip_low and method.clip_high must be >= 0")
    if m.dual_clip is not None and m.dual_clip <= 1:
        raise ConfigError(f"method.dual_clip must be > 1 (or null), got {m.dual_clip}")


def validate_refresh(m: MethodConfig) -> None:
    """CASPO's periodic refresh: a frozen value model between refreshes, positive sizes."""
    c = m.caspo
    if c.refresh_every < 0:
        raise ConfigError(f"method.caspo.refresh_every must be >= 0 (0 = never), got {c.refresh_every}")
    if not c.refresh_every:
        return
    if c.online:
        raise ConfigError("method.caspo.refresh_every and method.caspo.online=true are alternatives: "
                          "refresh a frozen value model, or train it online, not both")
    sizes = {"refresh_prompts": c.refresh_prompts, "refresh_j": c.refresh_j,
             "refresh_boundaries": c.refresh_boundaries, "refresh_epochs": c.refresh_epochs,
             "refresh_batch_size": c.refresh_batch_size}
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"method.caspo.{key} must be >= 1, got {value}")
    if c.refresh_k < 2:
        raise ConfigError(f"method.caspo.refresh_k must be >= 2: only prompts with mixed outcomes over their "
                          f"K rollouts are labelled, got {c.refresh_k}")
    if c.refresh_lr <= 0:
        raise ConfigError(f"method.caspo.refresh_lr must be > 0, got {c.refresh_lr}")
    if not 0 < c.refresh_val_fraction < 1:
        raise ConfigError(f"method.caspo.refresh_val_fraction must be in (0, 1), got {c.refresh_val_fraction}")
    if c.refresh_state_temperature < 0:
        raise ConfigError(f"method.caspo.refresh_state_temperature must be > 0, or 0 for the run's temperature; "
                          f"got {c.refresh_state_temperature}")


def validate_data(cfg: Config) -> None:
    """A held-out set that is not the training rows, and the evaluation's ranges."""
    d = cfg.data
    if d.heldout_fraction:
        if not 0 < d.heldout_fraction < 1:
            raise ConfigError(f"data.heldout_fraction must be in (0, 1) (0 = off), got {d.heldout_fraction}")
        if d.source == "arith":
            raise ConfigError("data.heldout_fraction splits a data file; arith has its own held-out split "
                              "(data.arith.heldout_pool_size): leave it at 0")
        if d.eval_source:
            raise ConfigError("data.eval_source and data.heldout_fraction are alternatives: evaluate on another "
                              "source, or hold out part of data.source, not both")
    if d.source != "arith" and not d.eval_source and not d.heldout_fraction and evaluates(cfg.eval):
        raise ConfigError(f"data.source={d.source!r} has no held-out problems: set data.eval_source (e.g. math500) "
                          "or data.heldout_fraction (e.g. 0.05), or turn evaluation off (eval.before=false "
                          "eval.after=false eval.every=0)")
    validate_eval(cfg.eval)


def evaluates(e: EvalConfig) -> bool:
    """Whether a run evaluates its held-out set at all."""
    return e.before or e.after or e.every > 0


def validate_eval(e: EvalConfig) -> None:
    if e.samples < 0:
        raise ConfigError(f"eval.samples must be >= 0 (0 = greedy accuracy only), got {e.samples}")
    if e.limit < 0:
        raise ConfigError(f"eval.limit must be >= 0 (0 = every problem), got {e.limit}")
    if e.temperature is not None and e.temperature <= 0:
        raise ConfigError(f"eval.temperature must be > 0 (greedy accuracy is always reported), got {e.temperature}")
    if e.top_p is not None and not 0 < e.top_p <= 1:
        raise ConfigError(f"eval.top_p must be in (0, 1], got {e.top_p}")
    if e.max_new_tokens < 1:
        raise ConfigError(f"eval.max_new_tokens must be >= 1, got {e.max_new_tokens}")
    seen = set()
    for name in e.benchmarks:
        if not name.strip() or name in seen:
            raise ConfigError(f"eval.benchmarks: {name!r} is empty or listed twice; list each benchmark once")
        seen.add(name)


MIN_WORKER_MEMORY_MB = 256  # a reward worker holds ~65 MB of address space after importing math-verify


def validate_reward(w: RewardConfig) -> None:
    """The verifier's limits (caspo.reward.pool): non-negative, and a recycle bound below the memory limit."""
    if w.workers < 0:
        raise ConfigError(f"reward.workers must be >= 0 (0 = score in the trainer's process), got {w.workers}")
    if w.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s must be > 0, got {w.timeout_s}")
    memory = w.worker_memory_mb
    if memory is not None and (memory < 0 or 0 < memory < MIN_WORKER_MEMORY_MB):
        raise ConfigError(f"reward.worker_memory_mb must be >= {MIN_WORKER_MEMORY_MB}, 0 (no limit) or null "
                          f"(2048 where the platform can limit it), got {w.worker_memory_mb}")
    for key in ("recycle_after", "recycle_rss_mb", "batch_budget_s"):
        if getattr(w, key) < 0:
            raise ConfigError(f"reward.{key} must be >= 0 (0 = off), got {getattr(w, key)}")
    if w.worker_memory_mb and w.recycle_rss_mb >= w.worker_memory_mb:
        raise ConfigError(f"reward.recycle_rss_mb={w.recycle_rss_mb} must be below reward.worker_memory_mb="
                          f"{w.worker_memory_mb}, or a worker hits its limit before it is recycled")
    if w.max_answer_chars < 1:
        raise ConfigError(f"reward.max_answer_chars must be >= 1, got {w.max_answer_chars}")
