"""What one run holds between steps, how it is built, saved and restored."""

from __future__ import annotations

import copy
import gc
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from caspo.config import ABSENT, Config, ConfigError, config_changes, describe_changes, to_dict, to_yaml
from caspo.data.build import TaskData, load_task_data
from caspo.data.cursor import PromptCursor
from caspo.device_memory import limit_device_memory
from caspo.methods import Method, resolve_method
from caspo.models.policy import compile_if_asked, load_policy, recompute_if_asked, resolve_device, resolve_model_path
from caspo.models.provenance import model_identity, tokenizer_hash
from caspo.models.tokenizer import load_tokenizer
from caspo.precision import LossScaler
from caspo.reward.pool import RewardPool
from caspo.rollout.base import Engine, SamplingParams, publish
from caspo.rollout.factory import build_engine, max_seq_len, sampling_params
from caspo.train import checkpoint as ckpt
from caspo.train import distributed, fsdp, sharded
from caspo.train.method_state import MethodState
from caspo.train.optim import Learner, allocate_state, learner


@dataclass
class Trainer:
    cfg: Config
    method: Method  # the row: advantage function, loss, whitening, schedule
    run_dir: Path
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    actor: Learner  # the policy with its optimizer
    ref: torch.nn.Module | None  # frozen original base: the KL anchor, never the resumed weights
    method_state: MethodState  # what the method owns: critic, value model, frozen old policy, ...
    engine: Engine
    cursor: PromptCursor
    update_rng: torch.Generator
    data: TaskData
    pool: RewardPool
    scaler: LossScaler
    step: int = 0  # outer steps completed
    version: int = 0  # updates applied to the actor
    # rollout.staleness > 0: CPU copies of the last versions (this rank's shards), so the engine can serve an old one
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    base: dict = field(default_factory=dict)  # what model.policy loaded: a resume must find the same (base_identity)

    @property
    def policy(self) -> torch.nn.Module:
        return self.actor.model

    @property
    def sampling(self) -> SamplingParams:
        return sampling_params(self.cfg, self.tokenizer, self.policy)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic() -> None:
    """Deterministic kernels; the environment is inherited by every worker process started later."""
    os.environ.update(distributed.DETERMINISTIC_ENV)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def build_trainer(cfg: Config) -> Trainer:
    method = resolve_method(cfg)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    if cfg.train.deterministic:
        set_deterministic()
    seed_everything(cfg.train.seed)
    device = resolve_device(cfg.model.device)
    limit_device_memory(device, cfg.model.device_memory_gib)  # before anything is allocated on it
    path = resolve_model_path(cfg.model.policy, cfg.model.revision)
    tokenizer = load_tokenizer(path)
    read_on = fsdp.read_device(device)  # several processes: rank 0's host, a skeleton elsewhere (filled when sharded)
    policy = load_policy(path, read_on).eval()
    base = distributed.on_main(base_identity, policy, tokenizer)  # rank 0 holds the weights
    recompute_if_asked(cfg.train, policy)
    data = load_task_data(cfg, tokenizer)
    needs_ref = cfg.method.kl_coef > 0 or cfg.method.kl_reward_coef > 0
    actor = learner(policy, cfg)
    ref = copy.deepcopy(policy).requires_grad_(False) if needs_ref else None
    compile_if_asked(cfg.train, policy, ref)
    method_state = method.state.build(cfg, path, policy, tokenizer, read_on)
    engine = None
    if distributed.active():  # the engine sleeps while the models are sharded; a publication fills it after
        engine = build_engine(cfg, policy, tokenizer, max_seq_len(cfg), device=device)
        engine.sleep(weights=True)
        actor, ref = shard(cfg, actor, ref, method_state)
        gc.collect()  # the optimizers replaced by `shard` sit in cycles with their schedulers, holding whole weights
    for lr in [actor, *method_state.learners.values()]:  # allocated before the engine reserves its KV cache
        allocate_state(lr.optimizer)
    if engine is not None:
        engine.wake()  # its weights come back with the publication below
    tr = Trainer(
        cfg=cfg, method=method, run_dir=distributed.log_dir(Path(cfg.train.output_dir)), device=device,
        tokenizer=tokenizer,
        actor=actor, ref=ref, method_state=method_state,
        engine=engine if engine is not None else build_engine(cfg, policy, tokenizer, max_seq_len(cfg)),
        cursor=PromptCursor(len(data.train), cfg.train.seed),
        update_rng=torch.Generator().manual_seed(cfg.train.seed), data=data,
        pool=RewardPool.from_config(cfg.reward),
        scaler=LossScaler(cfg.train.precision, cfg.train.loss_scale), base=base,
    )
    if cfg.rollout.staleness or distributed.active():  # version 0 recorded, or the woken engine's weights
        publish_current(tr)
    return tr


def base_identity(policy: torch.nn.Module, tokenizer) -> dict:
    """Fingerprints of what `model.policy` holds: its weights (the KL reference is a copy of them, and CASPO's
    value model was labelled by them) and its tokenizer. A resumed run must load the same."""
    return {"policy": model_identity(policy), "tokenizer": tokenizer_hash(tokenizer)}


def shard(cfg: Config, actor: Learner, ref: torch.nn.Module | None,
          state: MethodState) -> tuple[Learner, torch.nn.Module | None]:
    """FSDP2 over the policy and the reference (the policy's optimizer built again after wrapping), and over the
    models the method state owns (the critic, flow_dppo's old policy, CASPO's value model: `MethodState.shard`)."""
    actor = fsdp.rebuild(actor, fsdp.shard_routed(actor.model, cfg.train.precision))
    if ref is not None:
        fsdp.shard_routed(ref, cfg.train.precision)
    state.shard(cfg.train.precision)
    return actor, ref


def publish_current(tr: Trainer) -> None:
    """Publish what the engine should serve now: the actor's weights, or, with rollout.staleness=k,
    the version of k updates ago (as an asynchronous trainer would be serving)."""
    k = tr.cfg.rollout.staleness
    if k == 0:
        publish(tr.engine, tr.policy, tr.version)
        return
    tr.snapshots[tr.version] = fsdp.local_copies(tr.policy)
    serve = max(0, tr.version - k)
    for v in [v for v in tr.snapshots if v < serve]:
        del tr.snapshots[v]
    params = dict(tr.policy.named_parameters())
    tr.engine.begin(serve)
    for name, local in tr.snapshots[serve].items():  # a sharded one gathered whole, one tensor at a time
        tr.engine.load({name: fsdp.like(params[name], local)})
    tr.engine.commit()


# ---------------------------------------------------------------- checkpoints


def export_state(model: torch.nn.Module, precision: str) -> dict[str, torch.Tensor] | None:
    """The model's tensors as it is published (`ckpt.export_tensors`), with no second copy of the model on the
    card; None at fp32, where the model's own are."""
    return None if precision == "fp32" else ckpt.export_tensors(model, model.state_dict(), precision)


def learners(tr: Trainer) -> dict[str, Learner]:
    """The trained models, each saved in its own folder; GRPO-like methods save only the policy."""
    return {"policy": tr.actor, **tr.method_state.learners}


def trainer_state(tr: Trainer) -> dict:
    """The exact training state; the fp32 master weights travel here unless the HF export is them."""
    state = {
        "step": tr.step, "version": tr.version, "config": to_dict(tr.cfg),
        "optimizers": {k: lr.optimizer.state_dict() for k, lr in learners(tr).items()},
        "schedulers": {k: lr.scheduler.state_dict() for k, lr in learners(tr).items()},
        "loss_scaler": tr.scaler.state_dict(), "cursor": tr.cursor.state_dict(),
        "update_rng": tr.update_rng.get_state(), "rng": ckpt.rng_state(), "snapshots": tr.snapshots,
        "base": tr.base, **tr.method_state.state_dict(),
    }
    if tr.cfg.train.precision != "fp32":
        state["master_weights"] = {k: lr.model.state_dict() for k, lr in learners(tr).items()}
    return state


def sharded_trainer_state(tr: Trainer) -> dict:
    """Rank 0's part of a sharded checkpoint: the state every rank shares (the models and optimizers are in the
    shards; each rank's RNG and its shards of the engine's old versions in its own file)."""
    state = {
        "step": tr.step, "version": tr.version, "config": to_dict(tr.cfg), "world_size": distributed.size(),
        "learners": sorted(learners(tr)),
        "schedulers": {k: lr.scheduler.state_dict() for k, lr in learners(tr).items()},
        "loss_scaler": tr.scaler.state_dict(), "cursor": tr.cursor.state_dict(),
        "update_rng": tr.update_rng.get_state(), "base": tr.base, **tr.method_state.state_dict(),
    }
    return state


def save(tr: Trainer) -> Path:
    counters = {"step": tr.step, "version": tr.version, "skipped_steps": tr.scaler.skipped_steps}
    if distributed.active():
        return sharded.save(Path(tr.cfg.train.output_dir), tr.step, learners=learners(tr),
                            precision=tr.cfg.train.precision, tokenizer=tr.tokenizer,
                            trainer_state=sharded_trainer_state(tr),
                            rank_state={"rng": ckpt.rng_state(), "snapshots": tr.snapshots}, counters=counters,
                            config_yaml=to_yaml(tr.cfg), extra_files=tr.method_state.export_files())
    models = {k: lr.model for k, lr in learners(tr).items()}
    exports = {k: export_state(lr.model, tr.cfg.train.precision) for k, lr in learners(tr).items()}
    return ckpt.save_checkpoint(
        tr.run_dir, tr.step, models=models, tokenizer=tr.tokenizer,
        trainer_state=trainer_state(tr), config_yaml=to_yaml(tr.cfg),
        counters=counters, state_dicts={k: v for k, v in exports.items() if v is not None},
        extra_files=tr.method_state.export_files(),
    )


def restore(tr: Trainer, checkpoint: Path) -> list[str]:
    """Load weights and state, then publish the restored weights before anything generates. Returns the
    settings this config changes from the checkpoint's ("key: saved -> now")."""
    from safetensors.torch import load_model

    if distributed.active() or ckpt.is_sharded(checkpoint):
        return restore_sharded(tr, checkpoint)
    ckpt.verify_checkpoint(checkpoint)
    state = ckpt.load_trainer_state(checkpoint)
    check_state(checkpoint, state, [*STATE_KEYS, "optimizers", "rng", "snapshots"])
    changes = config_changes(state["config"], to_dict(tr.cfg))
    check_same_run(tr, checkpoint, state, state["optimizers"], changes)
    check_learner_states(tr, checkpoint, state, ["optimizers", "schedulers"]
                         + (["master_weights"] if "master_weights" in state else []))
    tr.method_state.load_state_dict(tr, state)
    for name, lr in learners(tr).items():
        if "master_weights" in state:
            lr.model.load_state_dict(state["master_weights"][name])
        else:
            load_model(lr.model, str(checkpoint / name / "model.safetensors"), device=str(tr.device))
        lr.optimizer.load_state_dict(state["optimizers"][name])
        lr.scheduler.load_state_dict(state["schedulers"][name])
    restore_counters(tr, state, rng=state["rng"], snapshots=state["snapshots"])
    return describe_changes(changes)


def restore_sharded(tr: Trainer, checkpoint: Path) -> list[str]:
    """`restore` of a checkpoint written by several processes, in as many."""
    if not distributed.active():
        raise ckpt.CheckpointError(f"{checkpoint} was written by several processes; resume it with --nproc as "
                                   "many as wrote it")
    error = None
    if distributed.is_main():  # one rank reads every file against the manifest
        try:
            ckpt.verify_checkpoint(checkpoint)
        except ckpt.CheckpointError as err:
            error = str(err)
    error = distributed.from_main(error)
    if error:
        raise ckpt.CheckpointError(error)
    state = ckpt.load_trainer_state(checkpoint)
    check_state(checkpoint, state, STATE_KEYS)
    changes = config_changes(state["config"], to_dict(tr.cfg))
    check_same_run(tr, checkpoint, state, state.get("learners", ()), changes)
    check_learner_states(tr, checkpoint, state, ["schedulers"])
    tr.method_state.load_state_dict(tr, state)
    own = sharded.restore(checkpoint, learners(tr), state.get("world_size", 1))
    for name, lr in learners(tr).items():
        lr.scheduler.load_state_dict(state["schedulers"][name])
    restore_counters(tr, state, rng=own["rng"], snapshots=own["snapshots"])
    return describe_changes(changes)


# what `restore` reads of every checkpoint's trainer state (a one-process one also "optimizers", "rng", "snapshots")
STATE_KEYS = ("step", "version", "config", "schedulers", "loss_scaler", "cursor", "update_rng")


def check_state(checkpoint: Path, state, keys) -> None:
    """The trainer state holds `keys`, and a config naming its method (CheckpointError if not)."""
    ckpt.check_state(checkpoint, state, keys)
    ckpt.check_state(checkpoint, state["config"], ["method"], "config")
    ckpt.check_state(checkpoint, state["config"]["method"], ["name"], "config.method")


def check_learner_states(tr: Trainer, checkpoint: Path, state: dict, entries: list[str]) -> None:
    """Each of `entries` of the trainer state holds every trained model's state (CheckpointError if not)."""
    for entry in entries:
        ckpt.check_state(checkpoint, state[entry], sorted(learners(tr)), entry)


def kept_by_the_optimizer_state(tr: Trainer) -> list[str]:
    """The settings of this run that a checkpoint's optimizer and scheduler states (and its loss scaler) restore
    whatever the config says now."""
    o, names = tr.cfg.optim, set(learners(tr))
    keys = ["optim.name", "optim.lr", "optim.weight_decay", "optim.warmup_steps", "optim.warmup_ratio",
            "optim.schedule"]
    keys += ["optim.betas", "optim.eps"] if o.name == "adamw" else ["optim.momentum"]
    keys += ["method.critic_lr"] if "critic" in names else []
    keys += ["method.caspo.online_value_lr"] if "value" in names else []
    keys += ["method.critic_weight_decay"] if names & {"critic", "value"} else []  # φ's too
    return keys + (["train.loss_scale"] if tr.cfg.train.precision == "fp16" else [])


def check_same_run(tr: Trainer, checkpoint: Path, state: dict, models, changes: dict) -> None:
    """Refuse a checkpoint of another method, or of other trained models, than this run's, one whose base model
    or tokenizer differs from what model.policy holds now, or one whose optimizer settings differ from this
    config's (`changes`, `config_changes` from the checkpoint's): its optimizer state would bring back its own."""
    method = state["config"]["method"]["name"]
    if method != tr.cfg.method.name or set(models) != set(learners(tr)):
        raise ConfigError(f"{checkpoint} holds a {method} run (models: {', '.join(sorted(models))}), "
                          f"not {tr.cfg.method.name}; resume with the run's own config (its config.yaml) or start a "
                          "new run")
    moved = [what for what, identity in state.get("base", {}).items() if tr.base.get(what) != identity]
    if moved:
        raise ConfigError(f"model.policy={tr.cfg.model.policy} now holds another {' and '.join(moved)} than the run "
                          f"of {checkpoint} started from; resume with the same base model (model.revision pins a hub "
                          "download) or start a new run")
    changed = [f"{key} {changes[key][0]} -> {changes[key][1]}" for key in kept_by_the_optimizer_state(tr)
               if key in changes and changes[key][0] not in (ABSENT, None)]  # one the checkpoint lacks: not comparable
    if changed:
        raise ConfigError(f"{checkpoint} was trained with other optimizer settings ({'; '.join(changed)}), which "
                          "its optimizer state would keep; resume with the run's own values (its config.yaml) or "
                          "start a new run")


def restore_counters(tr: Trainer, state: dict, *, rng: dict, snapshots: dict) -> None:
    """The loss scaler, the prompt cursor, the RNGs, the step and the version; then the engine's publication."""
    tr.scaler.load_state_dict(state["loss_scaler"])
    tr.cursor.load_state_dict(state["cursor"])
    tr.update_rng.set_state(state["update_rng"])
    ckpt.set_rng_state(rng)
    tr.step, tr.version, tr.snapshots = state["step"], state["version"], snapshots
    publish_current(tr)
