"""The policy update of one rollout: epochs × minibatches × micro-batches.

Each minibatch is one optimizer step. Its loss is normalised by the counts of the
whole minibatch (tokens, or non-empty rows), passed to every micro-batch as
`denom`, so the gradient does not depend on how the minibatch is split.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.train.forward import response_logprobs
from caspo.train.precision import LossScaler, autocast


ADDITIVE = {"pg_loss", "kl"}


def policy_loss(model, batch: RolloutBatch, cfg: Config, denom: torch.Tensor, norm_len: int):
    """Clipped surrogate (+ KL to the reference as a loss term) on one micro-batch."""
    m = cfg.method
    logp = response_logprobs(model, batch, cfg.rollout.temperature)
    loss, metrics = algo.ppo_clip_loss(
        logp, batch.old_logprobs, batch.advantages, batch.response_mask,
        clip_low=m.clip_low, clip_high=m.clip_high, dual_clip=m.dual_clip, agg=m.loss_agg, denom=denom,
    )
    metrics = dict(metrics, pg_loss=loss.detach())
    if m.kl_coef > 0:
        kl = algo.kl(logp, batch.ref_logprobs, m.kl_estimator)
        kl_loss = algo.aggregate(kl, batch.response_mask, m.loss_agg, norm_len=norm_len, denom=denom)
        loss = loss + m.kl_coef * kl_loss
        metrics["kl"] = kl_loss.detach()
    return loss, metrics


def accumulate_gradients(model, batch: RolloutBatch, rows: torch.Tensor, cfg: Config, scaler: LossScaler,
                         norm_len: int) -> list[dict]:
    """Backward of one minibatch (`rows`), micro-batch by micro-batch, normalised by the minibatch's counts."""
    denom = algo.aggregate_denom(batch.response_mask[rows], cfg.method.loss_agg, norm_len)
    out = []
    for start in range(0, len(rows), cfg.train.micro_batch_size):
        micro = batch.select(rows[start:start + cfg.train.micro_batch_size])
        with autocast(cfg.train.precision, micro.input_ids.device):
            loss, metrics = policy_loss(model, micro, cfg, denom, norm_len)
        scaler.scale_loss(loss).backward()
        out.append({"tokens": micro.response_mask.sum().item(), **metrics})
    return out


def policy_update(model, optimizer, scheduler, batch: RolloutBatch, cfg: Config, generator: torch.Generator,
                  scaler: LossScaler) -> dict:
    t = cfg.train
    norm_len = batch.responses.shape[1]
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    minibatches = 0
    model.train()
    for _ in range(t.epochs_per_rollout):
        order = torch.randperm(batch.size, generator=generator)
        for start in range(0, batch.size, t.minibatch_size):
            optimizer.zero_grad(set_to_none=True)
            for metrics in accumulate_gradients(model, batch, order[start:start + t.minibatch_size], cfg, scaler,
                                                norm_len):
                weight = metrics.pop("tokens")
                for k, v in metrics.items():
                    if k in ADDITIVE:  # micro-batch parts of the minibatch loss: sum them
                        sums[k] += float(v)
                    else:  # masked means: weight by tokens
                        sums[k] += float(v) * weight
                        counts[k] += weight
            if scaler.unscale_and_check(model.parameters()):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                sums["grad_norm"] += float(grad_norm)
                counts["grad_norm"] += 1
                optimizer.step()
            scheduler.step()  # a skipped update still uses its slot of the schedule
            minibatches += 1
    model.eval()
    stats = {k: sums[k] / (minibatches if k in ADDITIVE else max(counts[k], 1e-9)) for k in sums}
    stats["lr"] = scheduler.get_last_lr()[0]
    stats["skipped_steps"] = scaler.skipped_steps
    return stats
