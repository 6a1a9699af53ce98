"""The update of one rollout: epochs × minibatches × micro-batches, the policy and the method's learners.

Each minibatch is one optimizer step per learner (the policy first, then e.g. the
critic). Its loss is normalised by the counts of the whole minibatch (tokens, or
non-empty rows: `algo.Counts`), passed to every micro-batch as `denom`, so the gradient
does not depend on how the minibatch is split. With several processes each rank takes a
contiguous block of the minibatch's rows; every rank holds the whole batch, so
`denom` is the whole minibatch's counts, and FSDP sums the ranks' gradients
(`caspo.train.fsdp`): the same gradient as one process, up to the order of the sums.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from caspo import algo
from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.forward import hidden_kl, hidden_logprobs, hidden_token_loss, response_hidden
from caspo.precision import LossScaler, autocast, loss_scale
from caspo.train import distributed, fsdp
from caspo.train.advantages import minibatch_advantages, token_scope
from caspo.train.method_state import LearnerLoss, MethodState
from caspo.train.optim import Learner
from caspo.train.policy_losses import LossInputs

if TYPE_CHECKING:
    from caspo.methods import Method
    from caspo.train.trainer import Trainer

ADDITIVE = {"pg_loss", "kl", "vf_loss"}  # parts of a minibatch loss: summed over its micro-batches
EXTREMES = {"iw_min": min, "iw_max": max}  # over every token of the update, whichever micro-batch held it


def policy_loss(model, batch: RolloutBatch, cfg: Config, denom, norm_len: int, method: "Method",
                state: MethodState):
    """The method's policy loss (+ KL to the reference as a loss term) on one micro-batch.

    With `batch.old_is_current` (the proximal policy is the one being trained, see
    `old_is_current`), this forward's detached log-probs are the old ones, and are
    written into `batch.old_logprobs` for the caller. A token-separable loss has its
    gradient taken in the head's forward (`head_gradient_in_forward`).
    """
    m, T = cfg.method, cfg.rollout.temperature
    hidden = response_hidden(model, batch)
    inputs = LossInputs(logp=None, batch=batch, denom=denom)
    if method.loss.full_vocab:
        with torch.no_grad():  # through the old policy's FSDP root, when sharded: its head is read directly
            inputs.frozen_old_logp, inputs.divergence = fsdp.call(state.frozen_old_policy(), old_policy_reading,
                                                                  batch, model, hidden.detach(), T)

    def terms(logp):
        """(the method's loss, the KL term or None, the loss's metrics) at these log-probs. The KL term reduces
        by method.kl_loss_agg; its metric `kl` by method.loss_agg, as the loss does, whatever the term's."""
        if batch.old_is_current:
            batch.old_logprobs = logp.detach()
        loss, metrics = method.loss.fn(dataclasses.replace(inputs, logp=logp), m)
        if not m.kl_coef > 0:
            return loss, None, metrics
        kl = algo.kl(logp, batch.ref_logprobs, m.kl_estimator)
        mask = batch.response_mask
        metrics = dict(metrics, kl=algo.aggregate(kl.detach(), mask, m.loss_agg, norm_len=norm_len, denom=denom))
        return loss, algo.aggregate(kl, mask, m.kl_loss_agg or m.loss_agg, norm_len=norm_len, denom=denom), metrics

    def combined(loss, kl_loss):
        return loss if kl_loss is None else loss + m.kl_coef * kl_loss

    def total(logp):
        return combined(*terms(logp)[:2])

    if head_gradient_in_forward(method, cfg):
        loss, logp, entropy = hidden_token_loss(model, hidden, batch.responses, total, T, with_entropy=True,
                                                grad_scale=loss_scale(cfg.train.precision, cfg.train.loss_scale))
        with torch.no_grad():
            pg_loss, kl_loss, metrics = terms(logp)
    else:
        logp, entropy = hidden_logprobs(model, hidden, batch.responses, T, with_entropy=True)
        pg_loss, kl_loss, metrics = terms(logp)
        loss = combined(pg_loss, kl_loss)
    batch.update_ratios = (logp.detach() - batch.old_logprobs).exp() * batch.response_mask
    metrics = dict(metrics, pg_loss=pg_loss.detach(), entropy=algo.masked_mean(entropy, batch.response_mask))
    if m.ratio_skip is not None:
        loss, metrics["ratio_skipped"] = skip_high_ratio(loss, batch.update_ratios, batch.response_mask, m.ratio_skip)
    return loss, metrics


def skip_high_ratio(loss: torch.Tensor, ratios: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> tuple[torch.Tensor, float]:
    """(loss, 0.0), or (0 · loss, 1.0) when the micro-batch's mean ratio π/π_old over its response tokens exceeds
    `threshold`: upstream VinePPO's `ratio_threshold` (default 10), which drops a micro-batch (its policy and KL
    terms) whose policy moved so far that its loss could spike. The optimizer step goes on with the others."""
    if algo.masked_mean(ratios, mask).item() > threshold:
        return loss * 0.0, 1.0
    return loss, 0.0


def old_policy_reading(old: torch.nn.Module, batch: RolloutBatch, model: torch.nn.Module, hidden: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a full-vocabulary loss reads of the frozen old policy: its log-probs of the sampled tokens and
    KL(π_old ‖ π) per position, against `model`'s response states `hidden`."""
    old_hidden = response_hidden(old, batch)
    return (hidden_logprobs(old, old_hidden, batch.responses, temperature)[0],
            hidden_kl(old, old_hidden, model, hidden, temperature))


# Off: the head recomputes each chunk's logits in the backward, for any loss (benchmarks time both).
GRADIENT_IN_FORWARD = True


def head_gradient_in_forward(method: "Method", cfg: Config) -> bool:
    """Whether the update takes the policy loss's gradient in the head's forward (`caspo.algo.head_token_loss`):
    for a token-separable loss. Under fp16 that forward scales its gradients by the loss scale, as the
    backward's would be."""
    return GRADIENT_IN_FORWARD and method.loss.token_separable


def actor_loss(method: "Method", state: MethodState, norm_len: int) -> LearnerLoss:
    """The policy's loss of one micro-batch, in the form `accumulate_gradients` calls."""
    def loss(model, micro: RolloutBatch, cfg: Config, denom):
        return policy_loss(model, micro, cfg, denom, norm_len, method, state)
    return loss


def old_is_current(cfg: Config, policy: torch.nn.Module) -> bool:
    """Whether the old-log-prob pass would recompute exactly what the update's own forward gives.

    That holds when every row is trained once on the weights that scored it (μ = 1, one
    minibatch per rollout, no staleness), nothing reads π_old before the update
    (method.kl_reward_coef = 0), and the forward is the same in train mode (no dropout).
    train.old_logprobs=recompute keeps the pass anyway.
    """
    t = cfg.train
    return (t.old_logprobs == "auto" and t.epochs_per_rollout == 1 and t.minibatch_size >= cfg.responses_per_step
            and cfg.rollout.staleness == 0 and cfg.method.kl_reward_coef == 0 and not has_dropout(policy))


def has_dropout(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    rates = [getattr(config, key, 0.0) or 0.0 for key in ("attention_dropout", "hidden_dropout", "dropout")]
    return any(r > 0 for r in rates) or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def accumulate_gradients(model, batch: RolloutBatch, rows: torch.Tensor, cfg: Config, scaler: LossScaler,
                         norm_len: int, loss_fn: LearnerLoss, written: tuple[str, ...] = ()) -> list[dict]:
    """Backward of one minibatch (`rows`), micro-batch by micro-batch, normalised by the minibatch's counts;
    `loss_fn(model, micro, cfg, denom)` -> (loss, metrics), `denom` the minibatch's `algo.Counts`. The
    response-frame fields named in `written`, which the loss sets on its micro-batch, are copied back into
    the batch's rows."""
    denom = algo.Counts.of(batch.response_mask[rows], norm_len)
    rows = distributed.my_rows(rows)  # this rank's block of the minibatch; `denom` stays the whole minibatch's
    out = []
    for idx, micro, real in fsdp.micro_batches(batch, rows, cfg.train.micro_batch_size,
                                               cfg.train.micro_batch_tokens):
        with autocast(cfg.train.precision, micro.input_ids.device):
            loss, metrics = fsdp.call(model, loss_fn, micro, cfg, denom)
        if not real:  # a stand-in, so that every rank runs as many backwards: it adds zeros
            (loss * 0.0).backward()
            continue
        scaler.scale_loss(loss).backward()
        for name in written:
            getattr(batch, name)[idx, :micro.responses.shape[1]] = getattr(micro, name)
        out.append({"tokens": micro.response_mask.sum(), **metrics})  # read after the minibatch: no sync here
    return out


class UpdateStats:
    """An update's metrics: the parts of a minibatch loss (ADDITIVE) summed over its micro-batches and
    averaged over minibatches, extremes (EXTREMES) over all its tokens, masked means weighted by tokens, grad
    norms averaged over optimizer steps."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        self.extremes: dict[str, float] = {}
        self.norms: set[str] = set()
        self.minibatches = 0

    def add(self, metrics_list: list[dict]) -> None:
        for metrics in metrics_list:
            weight = float(metrics.pop("tokens"))
            for k, v in metrics.items():
                if k in EXTREMES:
                    if weight:  # a micro-batch without tokens has no extreme (its metric is a stand-in 0)
                        v = float(v)
                        self.extremes[k] = EXTREMES[k](self.extremes.get(k, v), v)
                elif k in ADDITIVE:
                    self.sums[k] += float(v)
                else:  # masked means: weight by tokens
                    self.sums[k] += float(v) * weight
                    self.counts[k] += weight

    def add_norm(self, key: str, grad_norm: float | None) -> None:
        self.norms.add(key)
        if grad_norm is not None:  # None: skipped for overflow
            self.sums[key] += grad_norm
            self.counts[key] += 1

    def result(self) -> dict:
        sums, counts = self.sums, self.counts
        extremes = dict(self.extremes)
        if distributed.active():  # the micro-batch sums over every rank's rows; the norms are global already
            sums |= distributed.all_sum({k: v for k, v in sums.items() if k not in self.norms})
            counts |= distributed.all_sum({k: v for k, v in counts.items() if k not in self.norms})
            for rank_extremes in distributed.gather_objects(self.extremes):
                for k, v in rank_extremes.items():
                    extremes[k] = EXTREMES[k](extremes.get(k, v), v)
        out = {k: sums[k] / (self.minibatches if k in ADDITIVE else max(counts[k], 1e-9)) for k in sums}
        return out | extremes


def train_minibatch(key: str, learner: Learner, batch: RolloutBatch, rows: torch.Tensor, cfg: Config,
                    scaler: LossScaler, norm_len: int, loss_fn: LearnerLoss, stats: UpdateStats,
                    written: tuple[str, ...] = ()) -> None:
    """One optimizer step of `learner` on the minibatch `rows`; its grad norm is recorded under `key`. The
    gradients are freed once applied: the phases until the next update (rollout, scoring, values) do not hold
    them, 4 bytes a parameter at fp32 masters."""
    learner.optimizer.zero_grad(set_to_none=True)
    stats.add(accumulate_gradients(learner.model, batch, rows, cfg, scaler, norm_len, loss_fn, written))
    stats.add_norm(key, optimizer_step(learner, scaler))
    learner.optimizer.zero_grad(set_to_none=True)


def optimizer_step(learner: Learner, scaler: LossScaler) -> float | None:
    """Unscale, check, clip at learner.grad_clip and step; None if the step was skipped for overflow."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    grad_norm = None
    finite = scaler.unscale_and_check(params)
    if distributed.active():  # each rank checked its shard: all step, or all skip
        everywhere = not distributed.any_rank(not finite)
        if finite and not everywhere:
            scaler.skipped_steps += 1
        finite = everywhere
    if finite:
        grad_norm = clip_gradients(params, learner.grad_clip)
        learner.optimizer.step()
    learner.scheduler.step()  # a skipped update still uses its slot of the schedule
    return grad_norm


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm at `max_norm`; returns the norm before clipping. Sharded gradients'
    norm is the norm over every rank's shards."""
    if not distributed.active():
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = fsdp.full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def loss_norm_len(cfg: Config) -> int:
    """seq-mean-token-sum-norm's constant length (Dr. GRPO's; verl pads responses to it): the generation budget,
    not this batch's longest response, so that the loss's scale does not move from step to step."""
    return cfg.rollout.max_new_tokens


def update(actor: Learner, batch: RolloutBatch, cfg: Config, method: "Method", state: MethodState,
           generator: torch.Generator, scaler: LossScaler) -> dict:
    t = cfg.train
    norm_len = loss_norm_len(cfg)
    stats = UpdateStats()
    # (grad-norm key, learner, loss): the policy first, then the method's own learners
    learners = [("grad_norm", actor, actor_loss(method, state, norm_len))] + [
        (f"{name}_grad_norm", state.learners[name], loss) for name, loss in state.learner_losses().items()]
    for _, learner, _ in learners:
        learner.model.train()
    lr = actor.scheduler.get_last_lr()[0]  # what the step's first update uses (the scheduler steps per update)
    advantages = batch.advantages  # whitened per minibatch: each minibatch reads its own whitening of them
    per_minibatch = token_scope(method, cfg.method) == "minibatch"
    batch.update_ratios = torch.zeros_like(batch.response_mask)
    # what the policy's forwards give back: its ratios (a later epoch's replace an earlier one's), and π_old
    policy_gives = ("old_logprobs", "update_ratios") if batch.old_is_current else ("update_ratios",)
    for _ in range(t.epochs_per_rollout):
        # rows whose ratios (and old log-probs) this rank's forwards gave in this epoch: the last epoch's stay
        filled = torch.zeros(batch.size, dtype=torch.bool)
        order = torch.randperm(batch.size, generator=generator)
        for start in range(0, batch.size, t.minibatch_size):
            rows = order[start:start + t.minibatch_size]
            filled[distributed.my_rows(rows)] = True
            if per_minibatch:
                batch.advantages = minibatch_advantages(advantages, batch.response_mask, rows, cfg.method.adv_clip)
            for key, learner, loss_fn in learners:
                train_minibatch(key, learner, batch, rows, cfg, scaler, norm_len, loss_fn, stats,
                                written=policy_gives if learner is actor else ())
            stats.minibatches += 1
    for _, learner, _ in learners:
        learner.model.eval()
    batch.advantages = advantages
    if distributed.active() and batch.old_is_current:  # each rank's forwards gave its rows' old log-probs
        batch.old_logprobs = distributed.share_rows(batch.old_logprobs, filled)
    if distributed.active():  # and their ratios
        batch.update_ratios = distributed.share_rows(batch.update_ratios, filled)
    out = stats.result()
    out["lr"] = lr
    out["skipped_steps"] = scaler.skipped_steps
    return out


def sleep_engine(tr: "Trainer") -> None:
    """Free the engine's KV cache and its copy of the weights for training (rollout.sleep_during_update).
    Called before the update, and before a value phase that trains (the critic's); the second call does nothing."""
    if tr.cfg.rollout.sleep_during_update and not tr.engine.asleep:
        tr.engine.sleep(weights=True)


def wake_engine(tr: "Trainer") -> None:
    """The engine's memory back for the next rollout; the publication that follows refills the weights."""
    if tr.engine.asleep:
        tr.engine.wake()
