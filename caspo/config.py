"""Typed run configuration: a YAML preset plus dotted command-line overrides.

    cfg = load_config("arith-tiny", ["method.name=grpo", "train.steps=50"])

Every section is a dataclass; loading walks the YAML against the field types, so
an unknown key or a value of the wrong type is an error naming its key path and
the expected type. `validate` then checks the shapes that must agree (whole
minibatches, ...), and `caspo.methods.resolve_method` the ones a method's row adds
(G >= 2 for GRPO, ...). Presets live in `caspo/presets/` and are addressed by name
or by path.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A configuration problem, with the key path and the fix in the message."""


@dataclass
class ModelConfig:
    # Policy checkpoint: an HF folder, a hub id, or "embedded:<name>" for one that ships with caspo.
    policy: str = "embedded:tiny-arith"
    # Where training runs: "cpu", "cuda", "cuda:1", ... ("auto" = cuda when available).
    device: str = "cpu"
    # CPU threads for torch (0 = leave torch's default).
    threads: int = 2


@dataclass
class ArithConfig:
    seed: int = 1234
    min_ops: int = 2
    max_ops: int = 5
    max_start: int = 50
    max_addend: int = 30
    mul_factors: list[int] = field(default_factory=lambda: [2, 3])
    max_value: int = 200
    heldout_size: int = 1000
    train_size: int = 20_000


@dataclass
class DataConfig:
    # "arith" (the procedural task) or a path to a JSONL file.
    source: str = "arith"
    # Held-out prompts: "arith" uses the task's held-out split; a JSONL path otherwise.
    eval_source: Optional[str] = None
    # Training examples used (0 = all).
    train_size: int = 0
    query_field: str = "problem"
    label_field: str = "answer"
    id_field: Optional[str] = None
    skip_invalid: bool = False
    template: str = "arith"
    add_bos: bool = False
    max_prompt_tokens: int = 256
    arith: ArithConfig = field(default_factory=ArithConfig)


@dataclass
class RolloutConfig:
    # "hf": transformers models (any architecture); "native": caspo's engine (Qwen2/Llama families, looped LMs)
    backend: Literal["hf", "native"] = "hf"
    # native engine: KV cache size in tokens on any device, or (capacity_tokens 0) its share of
    # device memory on CUDA / one step's requests on the CPU
    gpu_memory_fraction: float = 0.3
    capacity_tokens: int = 0
    cuda_graphs: bool = False
    prompts_per_step: int = 32
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    # Sequences decoded together; 0 = all requests of a step at once.
    max_batch: int = 0
    # Generate with the policy of `staleness` updates ago, as asynchronous RL does (0 = on-policy).
    staleness: int = 0
    # The engine's compute dtype; "auto" = the training precision's compute dtype.
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"


@dataclass
class RewardConfig:
    workers: int = 2
    timeout_s: float = 5.0
    # Control experiments: shuffle rewards within each batch before advantages.
    shuffle_within_batch: bool = False
    # Timing runs only (random-init models): reward 1 when the response's token ids sum to an
    # even number, instead of the verifier, so that advantages are non-zero.
    synthetic: bool = False


@dataclass
class CaspoConfig:
    # the prefix value model folder (from `caspo value train`)
    value_model: str = ""
    transform: Literal["value", "prob", "logprob"] = "prob"
    # online: one AdamW step of the value model per batch on BCE(σ(V(s_k)/β), R)
    online: bool = False
    online_value_lr: float = 1e-6
    # periodic refresh (caspo.value.refresh): every refresh_every steps (0 = never), checkpoint, label
    # prefixes of the current policy by Monte Carlo, train a fresh value model on them, resume with it.
    # The sizes are small enough for the `tests` preset; a real run wants phase 1's (`caspo value collect`).
    refresh_every: int = 0
    refresh_prompts: int = 64  # training prompts labelled (the first ones of the split)
    refresh_k: int = 4  # base rollouts per prompt
    refresh_j: int = 4  # continuations per labelled prefix
    refresh_boundaries: int = 2  # labelled step boundaries per rollout
    refresh_state_temperature: float = 0.0  # base rollouts' temperature (0: the run's; labels keep the run's)
    refresh_lr: float = 3e-4  # value training: AdamW learning rate (1.5B full fine-tunes want ~5e-6)
    refresh_epochs: int = 2
    refresh_batch_size: int = 16  # rollouts per value-model optimizer step
    refresh_val_fraction: float = 0.25  # prompts held out to pick the best checkpoint by Spearman ρ
    # clip whitened step advantages at ±step_adv_clip σ (0 = off)
    step_adv_clip: float = 3.0
    allow_provenance_mismatch: bool = False
    # the control: the value model's step values shuffled over all valid steps of each batch
    shuffle_values: bool = False


@dataclass
class MethodConfig:
    name: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    loss_agg: str = "token-mean"
    # group advantages: divide by the group's std (false = Dr. GRPO's s - mean)
    std_normalize: bool = True
    # ppo (terminal reward): standardise over "batch", "group", or "off"
    terminal_scope: Literal["batch", "group", "off"] = "batch"
    # advantage whitening over all valid tokens; "auto" = batch for GAE methods, none otherwise
    adv_whiten: Literal["auto", "none", "batch"] = "auto"
    # clip advantages at ±adv_clip (in units of σ after whitening); 0 = off
    adv_clip: float = 0.0
    # KL to the reference: a loss term (kl_coef × kl_estimator) and/or k1 folded into the reward
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    kl_reward_coef: float = 0.0
    # GAE and the critic
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-5
    value_clip: float = 0.2
    # decoupled PPO: bounds of the behaviour importance weight π_prox/μ
    iw_low: float = 0.5
    iw_high: float = 2.0
    # flow_dppo: gate threshold on KL(old‖new) over the vocabulary
    gate_threshold: float = 0.01
    # step-level methods (vineppo, caspo): how responses split into steps
    step_splitter: Literal["auto", "newline", "latex"] = "auto"  # auto: newline for arith, latex otherwise
    max_steps: int = 0  # 0 = no cap
    after_final_box: Literal["keep", "merge"] = "keep"
    vineppo_k: int = 9  # Monte Carlo continuations per step boundary
    caspo: CaspoConfig = field(default_factory=CaspoConfig)
    # dppo_tv / dppo_kl
    dppo_delta_low: float = 0.15
    dppo_delta_high: float = 0.15
    dppo_ratio_cap: float = 10.0


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-4
    momentum: float = 0.0  # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"


@dataclass
class TrainConfig:
    steps: int = 50
    output_dir: str = "runs/default"
    seed: int = 0
    # Responses per optimizer step; the rollout's responses must split into whole minibatches.
    minibatch_size: int = 128
    micro_batch_size: int = 32
    epochs_per_rollout: int = 1
    # fp32 | bf16 (bf16 compute, fp32 master weights) | fp16 (fp32 master weights, fixed loss scale)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = 128.0
    # Recompute activations: checkpoint each block (in every loop of a looped model).
    recompute: bool = False
    save_every: int = 0
    # Stop cleanly (checkpoint written) after this many outer steps of this process; 0 = run to train.steps.
    stop_after: int = 0
    # Deterministic kernels (and the environment they need), for bit-exact resume checks.
    deterministic: bool = False


@dataclass
class EvalConfig:
    heldout_size: int = 500
    max_new_tokens: int = 96
    batch_size: int = 250
    samples: int = 0  # > 0: also avg@k, the mean reward of this many samples per problem at the run's sampler
    every: int = 0
    before: bool = True
    after: bool = True


@dataclass
class SftConfig:
    # The tiny policy built from scratch: a Qwen2 causal LM, or a looped LM in either layout.
    architecture: Literal["qwen2", "looped-ouro", "looped-nanbeige"] = "qwen2"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    intermediate: int = 256
    depth: int = 4  # loops of a looped architecture
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    skip_last_prob: float = 0.5
    skip_last_when: str = "any"
    slip_prob: float = 0.0
    seed: int = 0
    eval_every: int = 200


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    @property
    def responses_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.samples_per_prompt


# ---------------------------------------------------------------- loading


def resolve_preset(preset: str | Path) -> Path:
    """A preset name ("arith-tiny") or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        return path
    named = PRESET_DIR / f"{preset}.yaml"
    if not named.exists():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(names)} (or pass a .yaml path)")
    return named


def load_config(preset: str | Path | None = None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if preset is not None:
        path = resolve_preset(preset)
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    cfg = build(Config, raw, "")
    validate(cfg)
    return cfg


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value")
    key, text = item.split("=", 1)
    return key.strip(), yaml.safe_load(text) if text.strip() else ""


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {key}: {part} is not a section")
    node[parts[-1]] = value


def build(cls, raw: Any, path: str):
    """Instantiate dataclass `cls` from `raw`, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def coerce(tp, value: Any, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and FLOAT_RE.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {tp}")


# ---------------------------------------------------------------- validation


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
    validate_refresh(m)
    if r.cuda_graphs and r.backend != "native":
        raise ConfigError("rollout.cuda_graphs=true needs rollout.backend=native")
    if r.staleness < 0:
        raise ConfigError(f"rollout.staleness must be >= 0, got {r.staleness}")
    if cfg.eval.samples < 0:
        raise ConfigError(f"eval.samples must be >= 0 (0 = greedy accuracy only), got {cfg.eval.samples}")
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


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
