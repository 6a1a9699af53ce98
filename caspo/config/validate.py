"""The checks a loaded config must pass before any method row is looked at.

- every float is finite, and every number is in its range: `RANGES`, one rule per key (`REFRESH_RANGES`
  apply when CASPO's refresh is on); a test checks that every numeric field of the schema has one;
- the settings that must agree (whole minibatches, a recycle bound below the memory limit, ...);
- `model.device` names a device kind.

`caspo.methods.resolve_method` adds the checks a method's row brings (G >= 2 for GRPO, ...), and the CLI
checks what only the data layer knows (template names, data files: `caspo.data.check`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from caspo.config.schema import Config, ConfigError, EvalConfig, MethodConfig, RewardConfig


@dataclass(frozen=True)
class Range:
    """low <= v <= high (< where open); `zero`: 0 is also allowed and means that; `note`: why, or what edges mean."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    zero: str = ""
    note: str = ""

    def holds(self, v: float) -> bool:
        if self.zero and v == 0:
            return True
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.zero:
            text += f", or 0 ({self.zero})"
        return text + (f" ({self.note})" if self.note else "")


def at_least(low: float, note: str = "") -> Range:
    return Range(low, note=note)


def above(low: float, note: str = "", zero: str = "") -> Range:
    return Range(low, low_open=True, note=note, zero=zero)


PROBABILITY = Range(0, 1)
FRACTION = Range(0, 1, low_open=True, high_open=True)  # a share that leaves both sides non-empty
TOP_P = Range(0, 1, low_open=True)
POSITIVE = above(0)
COUNT = at_least(1)
SEED = Range(0, 2**32 - 1, note="numpy's seed range")

RANGES: dict[str, Range] = {
    "model.threads": at_least(0, "0 = torch's default"),
    "model.device_memory_gib": above(0, zero="the whole card"),
    "data.heldout_fraction": Range(0, 1, low_open=True, high_open=True, zero="off"),
    "data.split_seed": SEED,
    "data.train_size": at_least(0, "0 = all"),
    "data.max_prompt_tokens": COUNT,
    "data.arith.seed": SEED,
    "data.arith.min_ops": COUNT,
    "data.arith.max_ops": COUNT,
    "data.arith.max_start": COUNT,
    "data.arith.max_addend": COUNT,
    "data.arith.mul_factors": at_least(2, "an empty list turns multiplication off"),
    "data.arith.max_value": at_least(2),
    "data.arith.heldout_pool_size": COUNT,
    "data.arith.train_size": COUNT,
    "rollout.gpu_memory_fraction": FRACTION,
    "rollout.capacity_tokens": at_least(0, "0 = sized by rollout.gpu_memory_fraction or the step's requests"),
    "rollout.prompts_per_step": COUNT,
    "rollout.samples_per_prompt": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": above(0, "for training rollouts"),
    "rollout.top_p": TOP_P,
    "rollout.top_k": at_least(0, "0 = off"),
    "rollout.max_batch": at_least(0, "0 = all requests of a step at once"),
    "rollout.admit_batch": at_least(0, "0 = an eighth of the running slots, at most 64"),
    "rollout.staleness": at_least(0, "0 = on-policy"),
    "reward.workers": at_least(0, "0 = score in the trainer's process"),
    "reward.timeout_s": POSITIVE,
    "reward.worker_memory_mb": at_least(0, "0 = no limit"),
    "reward.recycle_after": at_least(0, "0 = off"),
    "reward.recycle_rss_mb": at_least(0, "0 = off"),
    "reward.batch_budget_s": at_least(0, "0 = off"),
    "reward.max_answer_chars": COUNT,
    "method.clip_low": Range(0, 1, high_open=True, note="the ratio's lower bound is 1 - clip_low"),
    "method.clip_high": at_least(0),
    "method.dual_clip": above(1, "or null"),
    "method.ratio_skip": above(1, "or null"),
    "method.adv_clip": at_least(0, "0 = off"),
    "method.kl_coef": at_least(0),
    "method.kl_reward_coef": at_least(0),
    "method.gamma": PROBABILITY,
    "method.lam": PROBABILITY,
    "method.critic_lr": POSITIVE,
    "method.critic_weight_decay": at_least(0),
    "method.critic_grad_clip": POSITIVE,
    "method.value_clip": at_least(0),
    "method.iw_low": Range(0, 1, low_open=True),
    "method.iw_high": at_least(1),
    "method.gate_threshold": POSITIVE,
    "method.max_steps": at_least(0, "0 = no cap"),
    "method.vineppo_k": COUNT,
    "method.vineppo_context_tokens": at_least(0, "0 = the response's remaining budget"),
    "method.dppo_delta_low": at_least(0, "or null: the method's default"),
    "method.dppo_delta_high": at_least(0, "or null: the method's default"),
    "method.dppo_ratio_cap": at_least(1),
    "method.caspo.online_value_lr": POSITIVE,
    "method.caspo.refresh_every": at_least(0, "0 = never"),
    "method.caspo.step_adv_clip": at_least(0, "0 = off"),
    "optim.lr": POSITIVE,
    "optim.momentum": Range(0, 1, high_open=True),
    "optim.betas": Range(0, 1, high_open=True),
    "optim.eps": POSITIVE,
    "optim.weight_decay": at_least(0),
    "optim.grad_clip": POSITIVE,
    "optim.warmup_steps": at_least(0),
    "optim.warmup_ratio": Range(0, 1, high_open=True),
    "train.steps": COUNT,
    "train.seed": SEED,
    "train.minibatch_size": COUNT,
    "train.micro_batch_size": COUNT,
    "train.micro_batch_tokens": at_least(0, "0 = micro-batches of train.micro_batch_size rows"),
    "train.activation_checkpointing_every": at_least(1, "1 = every block"),
    "train.score_micro_batch_size": at_least(0, "0 = train.micro_batch_size"),
    "train.score_micro_batch_tokens": at_least(0, "0 = train.micro_batch_tokens"),
    "train.epochs_per_rollout": COUNT,
    "train.loss_scale": POSITIVE,
    "train.save_every": at_least(0, "0 = at the end only"),
    "train.stop_after": at_least(0, "0 = run to train.steps"),
    "train.max_bad_steps": at_least(0, "0 = never stop"),
    "train.collective_timeout_minutes": at_least(1),
    "train.log_samples": at_least(0),
    "train.health.no_reward_steps": COUNT,
    "train.health.rise_steps": COUNT,
    "train.health.memory_rise_steps": COUNT,
    "train.health.rise_cap_fraction": TOP_P,
    "train.health.kl_max": POSITIVE,
    "train.health.watchdog_s": at_least(0, "0 = no watchdog"),
    "eval.heldout_size": at_least(0),
    "eval.max_new_tokens": COUNT,
    "eval.samples": at_least(0, "0 = greedy accuracy only"),
    "eval.temperature": above(0, "greedy accuracy is always reported; null = the run's"),
    "eval.top_p": TOP_P,
    "eval.limit": at_least(0, "0 = every problem"),
    "eval.every": at_least(0, "0 = off"),
    "sft.layers": COUNT,
    "sft.hidden": COUNT,
    "sft.heads": COUNT,
    "sft.intermediate": COUNT,
    "sft.depth": COUNT,
    "sft.steps": COUNT,
    "sft.batch_size": COUNT,
    "sft.lr": POSITIVE,
    "sft.warmup_steps": at_least(0),
    "sft.min_lr_ratio": PROBABILITY,
    "sft.weight_decay": at_least(0),
    "sft.skip_last_prob": PROBABILITY,
    "sft.slip_prob": PROBABILITY,
    "sft.seed": SEED,
    "sft.eval_every": at_least(0, "0 = off"),
    "sft.eval_batch_size": COUNT,
}

# CASPO's periodic refresh (method.caspo.refresh_every > 0) uses these; unused otherwise, they are not checked
REFRESH_RANGES: dict[str, Range] = {
    "method.caspo.refresh_prompts": COUNT,
    "method.caspo.refresh_k": at_least(2, "only prompts with mixed outcomes over their K rollouts are labelled"),
    "method.caspo.refresh_j": COUNT,
    "method.caspo.refresh_boundaries": COUNT,
    "method.caspo.refresh_state_temperature": above(0, zero="the run's temperature"),
    "method.caspo.refresh_lr": POSITIVE,
    "method.caspo.refresh_epochs": COUNT,
    "method.caspo.refresh_batch_size": COUNT,
    "method.caspo.refresh_val_fraction": FRACTION,
    "method.caspo.refresh_max_train_prefix_len": at_least(0, "0 = keep all"),
}

DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")
MIN_WORKER_MEMORY_MB = 256  # a reward worker holds ~65 MB of address space after importing math-verify


def numbers(section: Any, prefix: str = "") -> Iterator[tuple[str, str, float]]:
    """(where, rule key, value) of every number in a config section; a list's items share its key."""
    for f in dataclasses.fields(section):
        key, value = prefix + f.name, getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from numbers(value, key + ".")
        elif isinstance(value, list):
            yield from ((f"{key}[{i}]", key, v) for i, v in enumerate(value) if is_number(v))
        elif is_number(value):
            yield key, key, value


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ranges(section: Any, rules: dict[str, Range], prefix: str = "") -> None:
    """Every float of `section` finite, and every number that has a rule in `rules` in its range."""
    for where, key, value in numbers(section, prefix):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value}")
        rule = rules.get(key)
        if rule is not None and not rule.holds(value):
            raise ConfigError(f"{where} must be {rule}, got {value}")


def validate(cfg: Config) -> None:
    """Checks that need no method row; `caspo.methods.resolve_method` adds the method's own."""
    check_ranges(cfg, RANGES)
    r, t = cfg.rollout, cfg.train
    if not DEVICE.fullmatch(cfg.model.device):
        raise ConfigError(f"model.device={cfg.model.device!r}: use cpu, cuda, cuda:N (a GPU's index) or auto "
                          "(cuda when available)")
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
    o = cfg.optim
    if o.warmup_steps and o.warmup_ratio:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} and optim.warmup_ratio={o.warmup_ratio} both set the "
                          "warmup: keep one, the other 0")
    if not t.save_last and cfg.eval.benchmarks:
        raise ConfigError("train.save_last=false leaves no last checkpoint for eval.benchmarks to evaluate: "
                          "set eval.benchmarks=[] or keep train.save_last=true")
    validate_reward(cfg.reward)
    validate_refresh(cfg.method)
    validate_data(cfg)
    validate_shapes(cfg)
    for i, stop in enumerate(r.stop):
        if not stop:
            raise ConfigError(f"rollout.stop[{i}] is empty (it would end every completion at once); remove it")
    if r.cuda_graphs and r.backend != "native":
        raise ConfigError("rollout.cuda_graphs=true needs rollout.backend=native")
    if r.shared_prefix_attention and r.backend != "native":
        raise ConfigError("rollout.shared_prefix_attention=true needs rollout.backend=native")
    if r.admit_batch and r.backend != "native":
        raise ConfigError(f"rollout.admit_batch={r.admit_batch} sets the native engine's admissions; it needs "
                          "rollout.backend=native")
    if r.capacity_tokens and r.backend != "native":  # the hf engine's cache lives only inside a generate call
        raise ConfigError(f"rollout.capacity_tokens={r.capacity_tokens} sizes the native engine's KV cache; it needs "
                          "rollout.backend=native")
    if r.admit_batch and r.max_batch and r.admit_batch > r.max_batch:
        raise ConfigError(f"rollout.admit_batch={r.admit_batch} exceeds rollout.max_batch={r.max_batch}, the "
                          "slots there are: lower it, or raise max_batch")
    if t.activation_checkpointing_every != 1 and not t.activation_checkpointing:
        raise ConfigError(f"train.activation_checkpointing_every={t.activation_checkpointing_every} chooses which "
                          "blocks train.activation_checkpointing checkpoints: set that to true, or this to 1")
    if t.compile and r.backend != "native":  # the hf engine would generate through the compiled blocks
        raise ConfigError("train.compile=true needs rollout.backend=native: the hf engine generates with the "
                          "policy's own blocks")


def validate_shapes(cfg: Config) -> None:
    """Settings that must agree with each other (beyond their single ranges)."""
    a, m, s = cfg.data.arith, cfg.method, cfg.sft
    if a.max_ops < a.min_ops:
        raise ConfigError(f"data.arith.max_ops={a.max_ops} must be >= data.arith.min_ops={a.min_ops}")
    if a.max_start > a.max_value:
        raise ConfigError(f"data.arith.max_start={a.max_start} must be <= data.arith.max_value={a.max_value}")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas must be two numbers [beta1, beta2], got {cfg.optim.betas}")
    if s.hidden % s.heads:
        raise ConfigError(f"sft.hidden={s.hidden} must be a multiple of sft.heads={s.heads}")
    if m.iw_low > m.iw_high:
        raise ConfigError(f"method.iw_low={m.iw_low} must be <= method.iw_high={m.iw_high}")
    if m.kl_loss_agg is not None and not m.kl_coef > 0:
        raise ConfigError(f"method.kl_loss_agg={m.kl_loss_agg} sums the KL loss term, and method.kl_coef=0 has none: "
                          "set method.kl_coef, or leave method.kl_loss_agg null")
    rollout_tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if 0 < m.vineppo_context_tokens < rollout_tokens:
        raise ConfigError(f"method.vineppo_context_tokens={m.vineppo_context_tokens} is shorter than a rollout "
                          f"(data.max_prompt_tokens + rollout.max_new_tokens = {rollout_tokens}); raise it to at "
                          f"least {rollout_tokens}, or set 0")


def validate_refresh(m: MethodConfig) -> None:
    """CASPO's periodic refresh: a frozen value model between refreshes, and the sizes of REFRESH_RANGES."""
    if not m.caspo.refresh_every:
        return
    if m.caspo.online:
        raise ConfigError("method.caspo.refresh_every and method.caspo.online=true are alternatives: "
                          "refresh a frozen value model, or train it online, not both")
    check_ranges(m.caspo, REFRESH_RANGES, "method.caspo.")


def validate_data(cfg: Config) -> None:
    """A held-out set that is not the training rows, and the evaluation's benchmarks."""
    d = cfg.data
    if d.heldout_fraction:
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
    seen = set()
    for name in e.benchmarks:
        if not name.strip() or name in seen:
            raise ConfigError(f"eval.benchmarks: {name!r} is empty or listed twice; list each benchmark once")
        seen.add(name)


def validate_reward(w: RewardConfig) -> None:
    """The verifier's limits (caspo.reward.pool): a memory limit a worker fits in, a recycle bound below it."""
    memory = w.worker_memory_mb
    if memory is not None and 0 < memory < MIN_WORKER_MEMORY_MB:
        raise ConfigError(f"reward.worker_memory_mb must be >= {MIN_WORKER_MEMORY_MB}, 0 (no limit) or null "
                          f"(2048 where the platform can limit it), got {w.worker_memory_mb}")
    if w.worker_memory_mb and w.recycle_rss_mb >= w.worker_memory_mb:
        raise ConfigError(f"reward.recycle_rss_mb={w.recycle_rss_mb} must be below reward.worker_memory_mb="
                          f"{w.worker_memory_mb}, or a worker hits its limit before it is recycled")
