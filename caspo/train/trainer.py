"""What one run holds between steps, how it is built, saved and restored."""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from caspo.config import Config, to_dict, to_yaml
from caspo.data.build import TaskData, load_task_data
from caspo.data.cursor import PromptCursor
from caspo.methods import Method, get_method
from caspo.models.critic import load_critic
from caspo.models.policy import enable_recompute, load_policy, resolve_device, resolve_model_path
from caspo.models.tokenizer import load_tokenizer
from caspo.reward.pool import RewardPool
from caspo.rollout.base import SamplingParams, publish
from caspo.rollout.factory import build_engine, max_seq_len, sampling_params
from caspo.train import checkpoint as ckpt
from caspo.train.optim import build_optimizer, build_scheduler
from caspo.train.precision import LossScaler, compute_dtype
from caspo.train.runlog import console
from caspo.train.update import Learner


@dataclass(frozen=True)
class ValueSource:
    """Where CASPO's value model comes from, recorded in every checkpoint: a refresh replaces it."""

    path: str  # the value model folder
    label_policy: str  # the model spec of the policy whose rollouts labelled it (its provenance must match)


@dataclass
class Trainer:
    cfg: Config
    method: Method
    run_dir: Path
    device: torch.device
    tokenizer: object
    actor: Learner
    critic: Learner | None
    ref: torch.nn.Module | None  # frozen original base: the KL anchor, never the resumed weights
    old: torch.nn.Module | None  # flow_dppo's frozen old policy, refreshed before each update
    value_model: object | None  # caspo: the prefix value model (PrefixValueModel)
    value_source: ValueSource | None  # caspo: where value_model was loaded from
    value: Learner | None  # caspo online: its φ with its optimizer
    engine: object  # an Engine (caspo.rollout.base)
    cursor: PromptCursor
    update_rng: torch.Generator
    data: TaskData
    pool: RewardPool
    scaler: LossScaler
    step: int = 0  # outer steps completed
    version: int = 0  # updates applied to the actor
    # rollout.staleness > 0: CPU copies of the last versions, so the engine can serve an old one
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def policy(self) -> torch.nn.Module:
        return self.actor.model

    @property
    def sampling(self) -> SamplingParams:
        return sampling_params(self.cfg, self.tokenizer)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic() -> None:
    """Deterministic kernels; the environment is inherited by every worker process started later."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["NCCL_ALGO"] = "Ring"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def load_value_model(cfg: Config, tokenizer, source: ValueSource, label_policy: torch.nn.Module, device):
    """CASPO's prefix value model, refused if it was trained under other conditions than this run's
    sampling of `label_policy` (the base policy, or the policy of the checkpoint a refresh labelled)."""
    from caspo.models.prefix_value import load_prefix_value
    from caspo.value.provenance import label_provenance

    c = cfg.method.caspo
    model = load_prefix_value(source.path, label_provenance(cfg, tokenizer, label_policy),
                              allow_mismatch=c.allow_provenance_mismatch, device=device)
    model.policy.requires_grad_(c.online).train(False)
    return model


def install_value_model(tr: "Trainer", source: ValueSource) -> None:
    """Replace the frozen value model by the one at `source` (a refreshed one), checking its provenance."""
    if tr.value is not None:
        raise ValueError(f"cannot replace the value model by {source.path}: this run trains its value model "
                         "online (method.caspo.online=true), and a refreshed model needs a frozen run")
    label_policy = load_policy(source.label_policy, tr.device)
    tr.value_model = load_value_model(tr.cfg, tr.tokenizer, source, label_policy, tr.device)
    tr.value_source = source


def learner(model: torch.nn.Module, cfg: Config, lr: float | None = None, schedule: str | None = None) -> Learner:
    """Optimizer and schedule, built after the model is final (ready for FSDP2 wrapping first)."""
    optim = cfg.optim if lr is None else dataclasses.replace(cfg.optim, lr=lr)
    optim = optim if schedule is None else dataclasses.replace(optim, schedule=schedule, warmup_steps=0)
    updates = cfg.train.steps * cfg.train.epochs_per_rollout * (cfg.responses_per_step // cfg.train.minibatch_size)
    optimizer = build_optimizer(model.parameters(), optim)
    return Learner(model, optimizer, build_scheduler(optimizer, warmup=optim.warmup_steps, total=updates,
                                                     schedule=optim.schedule))


def build_trainer(cfg: Config) -> Trainer:
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    if cfg.train.deterministic:
        set_deterministic()
    seed_everything(cfg.train.seed)
    method = get_method(cfg.method.name)
    device = resolve_device(cfg.model.device)
    path = resolve_model_path(cfg.model.policy)
    tokenizer = load_tokenizer(path)
    policy = load_policy(path, device).eval()
    if cfg.train.recompute:
        enable_recompute(policy)
    needs_ref = cfg.method.kl_coef > 0 or cfg.method.kl_reward_coef > 0
    critic = load_critic(path, device).eval() if method.needs_critic else None
    if critic is not None and cfg.train.recompute:
        enable_recompute(critic)
    data = load_task_data(cfg, tokenizer)
    value_source = ValueSource(cfg.method.caspo.value_model, cfg.model.policy) \
        if method.step_values == "prefix" else None
    value_model = load_value_model(cfg, tokenizer, value_source, policy, device) if value_source else None
    tr = Trainer(
        cfg=cfg, method=method, run_dir=Path(cfg.train.output_dir), device=device, tokenizer=tokenizer,
        actor=learner(policy, cfg),
        critic=learner(critic, cfg, lr=cfg.method.critic_lr) if critic is not None else None,
        ref=copy.deepcopy(policy).requires_grad_(False) if needs_ref else None,
        old=copy.deepcopy(policy).requires_grad_(False) if method.loss == "divergence_gate" else None,
        value_model=value_model, value_source=value_source,
        value=learner(value_model.policy, cfg, lr=cfg.method.caspo.online_value_lr, schedule="constant")
        if value_model is not None and cfg.method.caspo.online else None,
        engine=build_engine(cfg, policy, tokenizer, max_seq_len(cfg)),
        cursor=PromptCursor(len(data.train), cfg.train.seed),
        update_rng=torch.Generator().manual_seed(cfg.train.seed), data=data,
        pool=RewardPool(cfg.reward.workers, cfg.reward.timeout_s),
        scaler=LossScaler(cfg.train.precision, cfg.train.loss_scale),
    )
    if cfg.rollout.staleness:  # record version 0; otherwise the engine already serves these weights
        publish_current(tr)
    return tr


def publish_current(tr: Trainer) -> None:
    """Publish what the engine should serve now: the actor's weights, or, with rollout.staleness=k,
    the version of k updates ago (as an asynchronous trainer would be serving)."""
    k = tr.cfg.rollout.staleness
    if k == 0:
        publish(tr.engine, tr.policy, tr.version)
        return
    tr.snapshots[tr.version] = {n: p.detach().cpu().clone() for n, p in tr.policy.named_parameters()}
    serve = max(0, tr.version - k)
    for v in [v for v in tr.snapshots if v < serve]:
        del tr.snapshots[v]
    tr.engine.begin(serve)
    tr.engine.load(tr.snapshots[serve])
    tr.engine.commit()


# ---------------------------------------------------------------- checkpoints


def export(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The model as it is published: in the compute dtype."""
    return model if precision == "fp32" else copy.deepcopy(model).to(compute_dtype(precision))


def learners(tr: Trainer) -> dict[str, Learner]:
    """The trained models, each saved in its own folder; GRPO-like methods save only the actor."""
    return {"policy": tr.actor, **({"critic": tr.critic} if tr.critic is not None else {}),
            **({"value": tr.value} if tr.value is not None else {})}


def trainer_state(tr: Trainer) -> dict:
    """The exact training state; the fp32 master weights travel here unless the HF export is them."""
    state = {
        "step": tr.step, "version": tr.version, "config": to_dict(tr.cfg),
        "optimizers": {k: lr.optimizer.state_dict() for k, lr in learners(tr).items()},
        "schedulers": {k: lr.scheduler.state_dict() for k, lr in learners(tr).items()},
        "loss_scaler": tr.scaler.state_dict(), "cursor": tr.cursor.state_dict(),
        "update_rng": tr.update_rng.get_state(), "rng": ckpt.rng_state(), "snapshots": tr.snapshots,
        "value_source": dataclasses.asdict(tr.value_source) if tr.value_source is not None else None,
    }
    if tr.cfg.train.precision != "fp32":
        state["master_weights"] = {k: lr.model.state_dict() for k, lr in learners(tr).items()}
    return state


def save(tr: Trainer) -> Path:
    models = {k: export(lr.model, tr.cfg.train.precision) for k, lr in learners(tr).items()}
    return ckpt.save_checkpoint(
        tr.run_dir, tr.step, models=models, tokenizer=tr.tokenizer,
        trainer_state=trainer_state(tr), config_yaml=to_yaml(tr.cfg),
        counters={"step": tr.step, "version": tr.version, "skipped_steps": tr.scaler.skipped_steps},
    )


def restore_value_model(tr: Trainer, state: dict) -> None:
    """Continue with the value model the checkpoint trained with (after a CASPO refresh, the refreshed
    one), unless this run's config names another model than the checkpoint's run did."""
    recorded = state.get("value_source")
    if recorded is None:  # written before value sources were recorded: the config's model, which tr holds
        return
    recorded = ValueSource(**recorded)
    if recorded == tr.value_source:
        return
    configured_then = state["config"]["method"]["caspo"]["value_model"]
    if configured_then != tr.cfg.method.caspo.value_model:
        console.print(f"value model: {tr.value_source.path}, as configured (the checkpoint trained with "
                      f"{recorded.path})")
        return
    install_value_model(tr, recorded)
    console.print(f"value model: {recorded.path}, as the checkpoint trained with")


def restore(tr: Trainer, checkpoint: Path) -> None:
    """Load weights and state, then publish the restored weights before anything generates."""
    from safetensors.torch import load_model

    state = ckpt.load_trainer_state(checkpoint)
    if tr.value_model is not None:
        restore_value_model(tr, state)
    for name, lr in learners(tr).items():
        if "master_weights" in state:
            lr.model.load_state_dict(state["master_weights"][name])
        else:
            load_model(lr.model, str(checkpoint / name / "model.safetensors"), device=str(tr.device))
        lr.optimizer.load_state_dict(state["optimizers"][name])
        lr.scheduler.load_state_dict(state["schedulers"][name])
    tr.scaler.load_state_dict(state["loss_scaler"])
    tr.cursor.load_state_dict(state["cursor"])
    tr.update_rng.set_state(state["update_rng"])
    ckpt.set_rng_state(state["rng"])
    tr.step, tr.version, tr.snapshots = state["step"], state["version"], state["snapshots"]
    publish_current(tr)
