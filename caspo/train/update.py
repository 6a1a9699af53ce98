"""The update of one rollout: epochs × minibatches × micro-batches, policy and critic.

Each minibatch is one optimizer step. Its loss is normalised by the counts of the
whole minibatch (tokens, or non-empty rows), passed to every micro-batch as
`denom`, so the gradient does not depend on how the minibatch is split.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.methods import Method, get_method
from caspo.models.critic import critic_values
from caspo.train.forward import response_logits, response_logprobs
from caspo.train.precision import LossScaler, autocast

ADDITIVE = {"pg_loss", "kl", "vf_loss"}  # parts of a minibatch loss: summed over its micro-batches


@dataclass
class Learner:
    """A model with its optimizer and schedule."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object


def policy_loss(model, batch: RolloutBatch, cfg: Config, method: Method, denom, norm_len: int, old_model=None):
    """The method's policy loss (+ KL to the reference as a loss term) on one micro-batch."""
    m, T = cfg.method, cfg.rollout.temperature
    mask, adv = batch.response_mask, batch.advantages
    common = dict(agg=m.loss_agg, denom=denom)
    if method.loss == "divergence_gate":
        logp_full = torch.log_softmax(response_logits(model, batch, T).float(), -1)
        with torch.no_grad():
            old_full = torch.log_softmax(response_logits(old_model, batch, T).float(), -1)
        loss, metrics = algo.divergence_gate_loss(logp_full, old_full, batch.responses, adv, mask,
                                                  threshold=m.gate_threshold, **common)
        logp = logp_full.gather(-1, batch.responses[..., None]).squeeze(-1)
    else:
        logp = response_logprobs(model, batch, T)
        clip = dict(clip_low=m.clip_low, clip_high=m.clip_high, dual_clip=m.dual_clip)
        if method.loss == "ppo_clip":
            loss, metrics = algo.ppo_clip_loss(logp, batch.old_logprobs, adv, mask, **clip, **common)
        elif method.loss == "decoupled":  # proximal = trainer-recomputed, behaviour = engine
            loss, metrics = algo.decoupled_ppo_loss(logp, batch.old_logprobs, batch.behaviour_logprobs, adv, mask,
                                                    weight_bounds=(m.iw_low, m.iw_high), **clip, **common)
        elif method.loss == "dppo_binary":
            loss, metrics = algo.dppo_binary_loss(logp, batch.old_logprobs, adv, mask, divergence=method.divergence,
                                                  delta_low=m.dppo_delta_low, delta_high=m.dppo_delta_high,
                                                  ratio_cap=m.dppo_ratio_cap, **common)
        else:
            raise ValueError(f"method {method.name}: unknown loss {method.loss!r}")
    metrics = dict(metrics, pg_loss=loss.detach())
    if m.kl_coef > 0:
        kl = algo.kl(logp, batch.ref_logprobs, m.kl_estimator)
        kl_loss = algo.aggregate(kl, mask, m.loss_agg, norm_len=norm_len, denom=denom)
        loss = loss + m.kl_coef * kl_loss
        metrics["kl"] = kl_loss.detach()
    return loss, metrics


def critic_loss(critic, batch: RolloutBatch, cfg: Config, denom):
    values = critic_values(critic, batch)
    loss, metrics = algo.value_loss(values, batch.values, batch.returns, batch.response_mask,
                                    clip=cfg.method.value_clip, agg=cfg.method.loss_agg, denom=denom)
    return loss, dict(metrics, vf_loss=loss.detach())


def accumulate_gradients(model, batch: RolloutBatch, rows: torch.Tensor, cfg: Config, scaler: LossScaler,
                         norm_len: int, method: Method | None = None, old_model=None, critic=False) -> list[dict]:
    """Backward of one minibatch (`rows`), micro-batch by micro-batch, normalised by the minibatch's counts."""
    method = method or get_method(cfg.method.name)
    denom = algo.aggregate_denom(batch.response_mask[rows], cfg.method.loss_agg, norm_len)
    out = []
    for start in range(0, len(rows), cfg.train.micro_batch_size):
        micro = batch.select(rows[start:start + cfg.train.micro_batch_size])
        with autocast(cfg.train.precision, micro.input_ids.device):
            if critic:
                loss, metrics = critic_loss(model, micro, cfg, denom)
            else:
                loss, metrics = policy_loss(model, micro, cfg, method, denom, norm_len, old_model)
        scaler.scale_loss(loss).backward()
        out.append({"tokens": micro.response_mask.sum().item(), **metrics})
    return out


def optimizer_step(learner: Learner, scaler: LossScaler, grad_clip: float) -> float | None:
    """Unscale, check, clip and step; None if the step was skipped for overflow."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    grad_norm = None
    if scaler.unscale_and_check(params):
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        learner.optimizer.step()
    learner.scheduler.step()  # a skipped update still uses its slot of the schedule
    return grad_norm


def update(policy: Learner, critic: Learner | None, batch: RolloutBatch, cfg: Config, method: Method,
           generator: torch.Generator, scaler: LossScaler, old_model=None) -> dict:
    t = cfg.train
    norm_len = batch.responses.shape[1]
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    minibatches = 0

    def record(metrics_list):
        for metrics in metrics_list:
            weight = metrics.pop("tokens")
            for k, v in metrics.items():
                if k in ADDITIVE:
                    sums[k] += float(v)
                else:  # masked means: weight by tokens
                    sums[k] += float(v) * weight
                    counts[k] += weight

    learners = [(policy, False)] + ([(critic, True)] if critic is not None else [])
    for learner, _ in learners:
        learner.model.train()
    for _ in range(t.epochs_per_rollout):
        order = torch.randperm(batch.size, generator=generator)
        for start in range(0, batch.size, t.minibatch_size):
            rows = order[start:start + t.minibatch_size]
            for learner, is_critic in learners:
                learner.optimizer.zero_grad(set_to_none=True)
                record(accumulate_gradients(learner.model, batch, rows, cfg, scaler, norm_len, method, old_model,
                                            critic=is_critic))
                grad_norm = optimizer_step(learner, scaler, cfg.optim.grad_clip)
                if grad_norm is not None:
                    key = "critic_grad_norm" if is_critic else "grad_norm"
                    sums[key] += grad_norm
                    counts[key] += 1
            minibatches += 1
    for learner, _ in learners:
        learner.model.eval()
    stats = {k: sums[k] / (minibatches if k in ADDITIVE else max(counts[k], 1e-9)) for k in sums}
    stats["lr"] = policy.scheduler.get_last_lr()[0]
    stats["skipped_steps"] = scaler.skipped_steps
    return stats
