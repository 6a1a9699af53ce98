"""The trainer's sections of the run configuration: `train`, with its `health` and `wandb` (`schema` has the rest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class WandbConfig:
    project: str = "caspo"
    entity: Optional[str] = None
    name: Optional[str] = None  # null = the run folder's name
    # "offline" writes under <run>/wandb/ (`wandb sync` uploads it later); "online" needs a login
    mode: Literal["offline", "online"] = "offline"


@dataclass
class HealthConfig:
    # Each detector (docs/monitoring.md): "warn" prints and records it, "stop" checkpoints and stops the
    # run, "off" skips it.
    # reward 0 and pass@G 0 (no group with a correct sample) for no_reward_steps steps in a row
    no_reward: Literal["off", "warn", "stop"] = "stop"
    no_reward_steps: int = 5
    # response length, or steps per response, rising over rise_steps steps to rise_cap_fraction of its cap
    # (rollout.max_new_tokens; method.max_steps for steps, else the length must be near its cap too)
    length_rise: Literal["off", "warn", "stop"] = "warn"
    rise_steps: int = 5
    rise_cap_fraction: float = 0.8
    # the update's KL to the reference (the `kl` metric, as method.loss_agg reduces it) above kl_max
    kl: Literal["off", "warn", "stop"] = "warn"
    kl_max: float = 1.0
    # CUDA memory allocated at a step's end rising in each of the last memory_rise_steps steps (a leak)
    memory_rise: Literal["off", "warn", "stop"] = "warn"
    memory_rise_steps: int = 10
    # a NaN or infinity in any metric of a step
    nan: Literal["off", "warn", "stop"] = "stop"
    # no outer step for this many seconds: a warning and <run>/status.json says "stalled" (0 = no watchdog)
    watchdog_s: float = 1800.0


@dataclass
class TrainConfig:
    steps: int = 50
    output_dir: str = "runs/default"
    seed: int = 0
    # Responses per optimizer step; the rollout's responses must split into whole minibatches.
    minibatch_size: int = 128
    micro_batch_size: int = 32
    # > 0: micro-batches packed by tokens instead: rows sorted by length, each micro-batch's padded
    # frame (rows × (longest prompt + longest response)) at most this many tokens and at most
    # micro_batch_size rows. The loss is still normalised over the whole minibatch.
    micro_batch_tokens: int = 0
    # The no-grad passes' micro-batches (old and reference log-probs, critic values, CASPO's prefix values),
    # rows and padded tokens as above; 0 = micro_batch_size / micro_batch_tokens. A forward without
    # gradients keeps no activations, so it can take larger micro-batches than the update.
    score_micro_batch_size: int = 0
    score_micro_batch_tokens: int = 0
    epochs_per_rollout: int = 1
    # "auto": skip the old-log-prob pass when the update's first forward gives the same log-probs
    # (μ = 1, one minibatch per rollout, no staleness, no KL reward, no dropout); "recompute": always run it;
    # "behaviour": no pass, π_old is the engine's sampling log-probs (slime's --use-rollout-logprobs, the looped
    # recipe's for ppo, grpo and flow-dppo), so the ratio carries the engine's difference from the trainer
    old_logprobs: Literal["auto", "recompute", "behaviour"] = "auto"
    # "auto": a critic trained once per rollout on the whole batch (μ = 1, one minibatch, no dropout) takes its
    # step in the value phase, and that step's first forward gives the values; "recompute": a values pass first
    critic_values: Literal["auto", "recompute"] = "auto"
    # fp32 | bf16 (bf16 compute, fp32 master weights) | fp16 (fp32 master weights, fixed loss scale)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = 128.0
    # Recompute activations in the backward: checkpoint each decoder block (in every loop of a looped model).
    activation_checkpointing: bool = False
    # With it on, checkpoint one block in n (blocks 0, n, 2n, ...; 1: all): the memory of the blocks left out for
    # their recompute, as torchtitan's selective layer checkpointing. Causal LMs with a `layers` list.
    activation_checkpointing_every: int = 1
    # torch.compile each decoder block of the models the trainer runs (policy, reference, critic, CASPO's φ and
    # its reference): the element-wise work between GEMMs is fused. The first steps pay the compilation;
    # needs causal LMs with a `layers` list (not looped models) and rollout.backend=native.
    compile: bool = False
    # torch.compile's backend for train.compile: "inductor" generates fused kernels; "aot_eager" (forward and
    # backward graphs) and "eager" (forward graphs) capture the same code and run it unfused, to tell a
    # compiler problem from a model problem
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    save_every: int = 0
    # false: no checkpoint after the run's last step (a measurement that needs none: at the seed's shape it is
    # ~24 GB and 46 s); a process stopped early by stop_after still writes its checkpoint to resume from
    save_last: bool = True
    # Stop cleanly (checkpoint written) after this many outer steps of this process; 0 = run to train.steps.
    stop_after: int = 0
    # Deterministic kernels (and the environment they need), for bit-exact resume checks.
    deterministic: bool = False
    # With several processes: how long a rank waits in a collective for the others before the run is ended
    # (NCCL's watchdog). Raise it where ranks can drift apart for longer, e.g. a refresh's label shards.
    collective_timeout_minutes: int = 30
    # Stop the run (the last good checkpoint kept) after this many consecutive outer steps with an update
    # skipped for non-finite gradients; 0 = never stop.
    max_bad_steps: int = 3
    # Where metrics go besides metrics.jsonl (which is always written; "jsonl" must be listed):
    # "tensorboard" (<run>/tensorboard/), "wandb" (pip install 'caspo[wandb]').
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = field(default_factory=lambda: ["jsonl"])
    log_samples: int = 8  # sample texts of each step in the trackers' table
    # Draw <run>/curves.png when the run ends or is stopped (about a second); `caspo report` draws it from
    # metrics.jsonl at any time
    curves: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
