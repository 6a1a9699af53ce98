"""Step-level values for `vineppo` and `caspo`: split each response into steps, value the states.

    token_step_ids  [B, R]  the step of each response token (−1 on padding), read off the
                            generated ids (caspo.segment), never a re-tokenization
    step_values     [B, S]  V(s_k), the state before step k; the state after the last step is
                            terminal (value 0) and is not stored
    vineppo         V(s_k) = mean 0/1 reward of K continuations from s_k (engine requests only)
    caspo           V(s_k) = β Σ_{tokens of steps < k} log π_φ/π_ref, from the prefix value model
"""

from __future__ import annotations

from functools import partial

import torch

from caspo.batch import RolloutBatch
from caspo.models.prefix_value import step_values as read_step_values
from caspo.segment import pad_step_ids, segment_response
from caspo.value.mc import continuation_seed, mc_step_values, step_start_indices


def splitter(cfg) -> str:
    s = cfg.method.step_splitter
    return s if s != "auto" else ("newline" if cfg.data.source == "arith" else "latex")


def segment(tr, batch: RolloutBatch) -> torch.Tensor:
    """[B, R] step id of every response token, −1 on padding."""
    m = tr.cfg.method
    decode = partial(tr.tokenizer.decode, skip_special_tokens=True)
    lengths = batch.response_lengths.tolist()
    rows = [segment_response(decode, batch.responses[b, :lengths[b]].tolist(), splitter=splitter(tr.cfg),
                             max_steps=m.max_steps or None, after_final_box=m.after_final_box).token_step_ids
            for b in range(batch.size)]
    step_ids, _ = pad_step_ids(rows, seq_len=batch.responses.shape[1])
    return step_ids.to(batch.responses.device)


def monte_carlo_values(tr, batch: RolloutBatch, step_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """VinePPO values: K continuations per distinct prefix, sampled by the rollout engine."""
    cfg = tr.cfg
    lengths = batch.response_lengths.tolist()
    responses = [batch.responses[b, :lengths[b]].tolist() for b in range(batch.size)]
    starts = [step_start_indices(step_ids[b, :lengths[b]].tolist()) for b in range(batch.size)]
    mc = mc_step_values(
        tr.engine, batch.extras["prompts"], responses, starts, batch.extras["labels"], k=cfg.method.vineppo_k,
        sampling=tr.sampling, max_new_tokens=cfg.rollout.max_new_tokens,
        seed_fn=partial(continuation_seed, cfg.train.seed, tr.step),
        scorer=lambda texts, labels, finished: tr.pool.score(texts, labels, finished).rewards,
        decode=partial(tr.tokenizer.decode, skip_special_tokens=True),
    )
    stats = {"mc_tokens": mc.mc_tokens, "mc_requests": mc.mc_requests, "mc_unique_prefixes": mc.unique_prefixes}
    return mc.values.to(batch.responses.device), mc.step_mask.to(batch.responses.device), stats


def micro_batches(tr, batch: RolloutBatch, step_ids: torch.Tensor):
    """(micro-batch, its step ids) pairs, with the response frame trimmed as `select` trims it."""
    mb = tr.cfg.train.micro_batch_size
    for start in range(0, batch.size, mb):
        idx = torch.arange(start, min(start + mb, batch.size))
        micro = batch.select(idx)
        yield idx, micro, step_ids[idx, :micro.responses.shape[1]]


@torch.no_grad()
def prefix_model_values(tr, batch: RolloutBatch, step_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """CASPO values from the prefix value model."""
    S = max(int(step_ids.max()) + 1, 1)
    values = torch.zeros(batch.size, S, device=step_ids.device)
    mask = torch.zeros_like(values)
    for idx, micro, ids in micro_batches(tr, batch, step_ids):
        v, m = read_step_values(tr.value_model.cumulative(micro), ids)
        values[idx, :v.shape[1]], mask[idx, :m.shape[1]] = v, m
    return values, mask, {}


def online_value_step(tr, batch: RolloutBatch, step_ids: torch.Tensor) -> dict:
    """One AdamW step of φ on the mean BCE of σ(V(s_k)/β) against the outcome R over the batch's
    step boundaries k >= 1 (V(s_0) = 0 whatever φ is)."""
    learner, beta = tr.value, tr.value_model.beta
    boundaries = float((step_ids.max(-1).values.clamp(min=0)).sum())  # steps after the first, per row
    learner.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for idx, micro, ids in micro_batches(tr, batch, step_ids):
        v, m = read_step_values(tr.value_model.cumulative(micro), ids)
        target = batch.rewards[idx].float()[:, None].expand_as(v)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(v / beta, target, reduction="none")
        loss = (bce * m)[:, 1:].sum() / max(boundaries, 1.0)
        loss.backward()
        total += loss.detach().item()
    learner.optimizer.step()
    learner.scheduler.step()
    return {"value_bce": total, "value_boundaries": boundaries}
