"""Step-level values for `vineppo` and `caspo`: split each response into steps, value the states.

    step_ids     [B, R]  the step of each response token (−1 on padding), read off the
                         generated ids (caspo.segment), never a re-tokenization
    step_values  [B, S]  V(s_k), the state before step k; the state after the last step is
                         terminal (value 0) and is not stored
    vineppo      V(s_k) = mean 0/1 reward of K continuations from s_k (engine requests only)
    caspo        V(s_k) = β Σ_{tokens of steps < k} log π_φ/π_ref, from the prefix value model,
                 stored as T(V(s_k)) for the step TD (method.caspo.transform)
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from caspo import algo
from caspo.algo import ipvrm
from caspo.batch import RolloutBatch
from caspo.config import Config, ConfigError
from caspo.models.policy import compile_if_asked, load_policy, recompute_if_asked
from caspo.models.prefix_value import CONFIG_FILE, PrefixValueModel, load_prefix_value, step_values, transform_values
from caspo.models.provenance import label_provenance
from caspo.models.tokenizer import batch_decoder
from caspo.precision import LossScaler, autocast
from caspo.reward.pool import TallyingScorer
from caspo.runlog import console
from caspo.segment import batch_step_splitter, pad_step_ids
from caspo.train import distributed, fsdp
from caspo.train.method_state import MethodState
from caspo.train.monte_carlo import continuation_seed, mc_step_values, step_start_indices
from caspo.train.optim import Learner, learner
from caspo.train.scoring import score_micro_batching
from caspo.train.update import optimizer_step

if TYPE_CHECKING:
    from caspo.train.trainer import Trainer


def control_seed(cfg: Config, step: int) -> int:
    """The seed of a control's permutation at `step` (shuffled rewards, shuffled values)."""
    return cfg.train.seed * 1_000_003 + step


def segment(tr: "Trainer", batch: RolloutBatch) -> torch.Tensor:
    """[B, R] step id of every response token, −1 on padding."""
    split = batch_step_splitter(tr.cfg, partial(tr.tokenizer.decode, skip_special_tokens=True),
                                *batch_decoder(tr.tokenizer))
    lengths = batch.response_lengths.tolist()
    rows = split([batch.responses[b, :lengths[b]].tolist() for b in range(batch.size)])
    step_ids, _ = pad_step_ids(rows, seq_len=batch.responses.shape[1])
    return step_ids.to(batch.responses.device)


def step_stats(batch: RolloutBatch, values: torch.Tensor) -> dict:
    return {"steps_mean": float(batch.step_mask.sum(-1).mean()),
            "step_value_mean": float(algo.masked_mean(values, batch.step_mask))}


class MonteCarloValues(MethodState):
    """VinePPO: K continuations per distinct prefix, sampled by the rollout engine. With several processes each
    rank values its block of prompts (a prompt's samples share their first state; every continuation's seed is
    its prefix's, so no value depends on the split), and the counters are the whole batch's."""

    def values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        cfg = tr.cfg
        batch.step_ids = segment(tr, batch)
        G = cfg.rollout.samples_per_prompt
        share = distributed.block(batch.size // G)
        rows = range(share.start * G, share.stop * G)
        lengths = batch.response_lengths.tolist()
        responses = [batch.responses[b, :lengths[b]].tolist() for b in rows]
        starts = [step_start_indices(batch.step_ids[b, :lengths[b]].tolist()) for b in rows]
        engine_stats = getattr(tr.engine, "stats", None)  # the native engine's prefill counters
        before = dataclasses.replace(engine_stats) if engine_stats else None
        scorer = TallyingScorer(tr.pool)  # the continuations the pool left without a verdict: mc_reward_unscored
        mc = mc_step_values(
            tr.engine, [batch.prompt_ids[b] for b in rows], responses, starts, [batch.labels[b] for b in rows],
            k=cfg.method.vineppo_k,
            sampling=tr.sampling, max_new_tokens=cfg.rollout.max_new_tokens,
            context_tokens=cfg.method.vineppo_context_tokens,
            seed_fn=partial(continuation_seed, cfg.train.seed, tr.step),
            scorer=scorer,
            decode=partial(tr.tokenizer.decode, skip_special_tokens=True),
            score_while_generating=tr.pool.workers > 0,  # inline scoring's timeouts need the main thread
        )
        device = batch.responses.device
        batch.step_values = distributed.gather_ragged(mc.values).to(device)
        batch.step_mask = distributed.gather_ragged(mc.step_mask).to(device)
        counts = {"mc_tokens": mc.mc_tokens, "mc_requests": mc.mc_requests, "mc_unique_prefixes": mc.unique_prefixes,
                  **scorer.unscored.counts("mc_reward_")}
        times = {"t_mc_generate": mc.generate_s, "t_mc_score": mc.score_s}  # this rank's
        if before is not None:  # the engine's counters over the continuations' generation
            during = engine_stats.since(before)
            counts |= {"mc_prefill_rounds": during.prefill_rounds, "mc_prefill_forwards": during.prefill_forwards,
                       "mc_decode_steps": during.decode_steps, "mc_decode_rows": during.decode_rows,
                       "mc_grouped_steps": during.grouped_steps,  # shared_prefix_attention
                       "mc_graph_captures": during.graph_captures,
                       "prefill_tokens": during.prefill_tokens, "shared_tokens": during.shared_tokens}
            # the engine's host time: admission rounds, blocked on the device, and the rest its own work
            times |= {"t_mc_capture": during.capture_s, "t_mc_prefill": during.prefill_s, "t_mc_wait": during.wait_s,
                      "t_mc_host": during.generate_s - during.prefill_s - during.wait_s}
        counts = {k: int(v) for k, v in distributed.all_sum(counts).items()}  # every rank's
        if before is not None:  # the share of the continuations' prompt positions copied from a resident slot
            shared, prefilled = counts.pop("shared_tokens"), counts.pop("prefill_tokens")
            counts["mc_prefill_shared_frac"] = shared / max(prefilled + shared, 1)
        return {**counts, **times, **step_stats(batch, batch.step_values)}


@dataclass(frozen=True)
class ValueSource:
    """Where CASPO's value model comes from, recorded in every checkpoint: a refresh replaces it."""

    path: str  # the value model folder
    label_policy: str  # the model spec of the policy whose rollouts labelled it (its provenance must match)


def load_value_model(cfg: Config, tokenizer, source: ValueSource, label_policy: torch.nn.Module,
                     device) -> PrefixValueModel:
    """CASPO's prefix value model, refused if it was trained under other conditions than this run's
    sampling of `label_policy` (the base policy, or the policy of the checkpoint a refresh labelled)."""
    c = cfg.method.caspo
    expected = distributed.on_main(label_provenance, cfg, tokenizer, label_policy)  # rank 0 holds the weights
    model = load_prefix_value(source.path, expected, allow_mismatch=c.allow_provenance_mismatch, device=device)
    model.policy.requires_grad_(c.online).train(False)
    if c.online:  # φ trains as the critic does: its blocks recomputed in the backward when asked
        recompute_if_asked(cfg.train, model.policy)
    compile_if_asked(cfg.train, model.policy, model.reference)
    return model


def shares_reference(cfg: Config, source: ValueSource, model: PrefixValueModel) -> bool:
    """Whether the trainer's reference scores are φ's reference scores, so that φ's reference need not run:
    the rollout temperature is 1 (the trainer scores at it, φ at 1), φ's reference has the weights of the
    policy that labelled it, and that policy is the run's base policy, which the trainer's reference copies
    (both identities checked at load, so not under allow_provenance_mismatch)."""
    p = model.provenance
    return (cfg.rollout.temperature == 1.0 and not cfg.method.caspo.allow_provenance_mismatch
            and source.label_policy == cfg.model.policy and p.reference == p.label_policy)


class PrefixValues(MethodState):
    """CASPO: step values from a prefix value model, frozen, trained online, or replaced by a refresh."""

    def __init__(self, cfg: Config, tokenizer, source: ValueSource, label_policy: torch.nn.Module, device):
        super().__init__()
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.source = source
        self.model = load_value_model(cfg, tokenizer, source, label_policy, device)
        self.shares_reference = shares_reference(cfg, source, self.model)
        self.online: Optional[Learner] = None
        if cfg.method.caspo.online:  # φ with its optimizer, saved in <checkpoint>/value/
            # a value learner like the critic: its weight decay and gradient clip, not the policy's
            self.online = learner(self.model.policy, cfg, lr=cfg.method.caspo.online_value_lr, schedule="constant",
                                  weight_decay=cfg.method.critic_weight_decay, grad_clip=cfg.method.critic_grad_clip)
            self.learners = {"value": self.online}

    @classmethod
    def build(cls, cfg: Config, policy_path: str, policy: torch.nn.Module, tokenizer, device: torch.device):
        return cls(cfg, tokenizer, ValueSource(cfg.method.caspo.value_model, cfg.model.policy), policy, device)

    def export_files(self) -> dict[str, dict[str, str]]:
        """An online φ's value_config.json beside its export, so that `<checkpoint>/value` loads as a value model
        (`load_prefix_value`). Its provenance is that of the labels φ started from; `trained_online` says the
        run trained it further on its own rollouts."""
        if self.online is None:
            return {}
        return {"value": {CONFIG_FILE: self.model.config_text(trained_online={"from": self.source.path})}}

    def shard(self, precision: str) -> None:
        """φ and its reference sharded as the policy is (every read a collective), the online learner's optimizer
        built again over φ's shards."""
        fsdp.shard_routed(self.model.policy, precision)
        fsdp.shard_routed(self.model.reference, precision)
        self.model.call = fsdp.call
        if self.online is not None:
            self.online = self.learners["value"] = fsdp.rebuild(self.online, self.model.policy)

    @torch.no_grad()
    def read(self, batch: RolloutBatch, micro_batch_size: int, max_tokens: int = 0,
             ref_logprobs: Optional[torch.Tensor] = None, keep_reference: bool = True,
             rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """V(s_k) [B, S], the step mask and the reference scores used [B, R] (None unless `keep_reference`),
        micro-batch by micro-batch, in the run's compute precision (φ and its reference in bf16 under
        train.precision=bf16, as the policy's own passes). `ref_logprobs` [B, R]: the reference's scores of
        the batch at temperature 1, given in place of a forward of φ's reference. `rows`: the rows read (every
        row by default; the others stay 0); with several processes every rank runs as many forwards."""
        S = max(int(batch.step_ids.max()) + 1, 1)
        values = torch.zeros(batch.size, S, device=batch.step_ids.device)
        mask = torch.zeros_like(values)
        reference = None
        rows = torch.arange(batch.size) if rows is None else rows
        for idx, micro, real in fsdp.micro_batches(batch, rows, micro_batch_size, max_tokens):
            R = micro.responses.shape[1]
            with autocast(self.cfg.train.precision, micro.input_ids.device):
                ref = self.model.reference_logprobs(micro) if ref_logprobs is None else ref_logprobs[idx, :R]
                v, m = step_values(self.model.cumulative(micro, ref), micro.step_ids)
            if not real:  # a stand-in: φ's forwards are collectives
                continue
            values[idx, :v.shape[1]], mask[idx, :m.shape[1]] = v, m
            if keep_reference:
                if reference is None:
                    reference = torch.zeros(batch.responses.shape, dtype=ref.dtype, device=ref.device)
                reference[idx, :R] = ref
        if keep_reference and reference is None:  # no rows here
            reference = torch.zeros(batch.responses.shape, device=values.device)
        return values, mask, reference

    def values(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        """V(s_k) of the batch's states; with several processes each rank reads its block of rows (φ sharded) and
        every rank receives them all."""
        c = tr.cfg.method.caspo
        batch.step_ids = segment(tr, batch)
        online = self.online is not None  # the reference is frozen: the online step reuses its scores
        values, batch.step_mask, reference = self.read_own_rows(tr, batch, keep_reference=online)
        if online:
            batch.value_ref_logprobs = reference
        if c.shuffle_values:
            values = shuffled_within_batch(values, batch.step_mask, seed=control_seed(tr.cfg, tr.step))
        batch.step_values = transform_values(values, c.transform, self.model.beta)
        return step_stats(batch, values)

    def read_own_rows(self, tr: "Trainer", batch: RolloutBatch, keep_reference: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """`read` of the batch, sharing the run's reference scores where φ's reference is the run's; with several
        processes of this rank's contiguous block of rows, then every rank's, on every rank."""
        rows = distributed.my_rows(torch.arange(batch.size))
        shared = batch.ref_logprobs if self.shares_reference and batch.ref_logprobs is not None else None
        out = self.read(batch, *score_micro_batching(tr.cfg), ref_logprobs=shared, keep_reference=keep_reference,
                        rows=rows)
        mine = torch.isin(torch.arange(batch.size), rows)
        return tuple(None if x is None else distributed.share_rows(x, mine) for x in out)

    def after_advantages(self, tr: "Trainer", batch: RolloutBatch) -> dict:
        t = tr.cfg.train
        if self.online is None:
            return {}
        return self.online_step(batch, t.micro_batch_size, t.micro_batch_tokens, tr.scaler)

    def online_step(self, batch: RolloutBatch, micro_batch_size: int, max_tokens: int = 0,
                    scaler: LossScaler | None = None) -> dict:
        """One step of φ (optim.name's optimizer) on the mean BCE of σ(V(s_k)/β) against the outcome R over the batch's
        step boundaries k >= 1 (V(s_0) = 0 whatever φ is); with method.caspo.use_adb / use_dlw, IPVRM's
        prompt-difficulty shift of the logits and outcome weights (caspo.algo.ipvrm). φ's reference runs only
        where the value read left no scores of it (batch.value_ref_logprobs). With several processes φ is sharded:
        each rank's loss is of its block of rows (normalised by the whole batch's boundaries), and FSDP sums the
        gradients. The loss is scaled, and the step skipped on non-finite gradients, as the update's
        (`scaler`, the run's; a fresh one of train.precision by default)."""
        scaler = scaler or LossScaler(self.cfg.train.precision, self.cfg.train.loss_scale)
        c, beta = self.cfg.method.caspo, self.model.beta
        boundaries = float((batch.step_ids.max(-1).values.clamp(min=0)).sum())  # steps after the first, per row
        rewards = batch.rewards.float()
        ones = torch.ones_like(rewards)
        shift = ipvrm.difficulty_boundary(rewards, batch.group_ids) if c.use_adb else torch.zeros_like(rewards)
        weight = ipvrm.outcome_weights(rewards, batch.group_ids) if c.use_dlw else ones
        self.online.optimizer.zero_grad(set_to_none=True)
        self.model.policy.train()  # as the critic's step (activation checkpointing runs in training mode only)
        total = 0.0
        rows = distributed.my_rows(torch.arange(batch.size))
        for idx, micro, real in fsdp.micro_batches(batch, rows, micro_batch_size, max_tokens):
            with autocast(self.cfg.train.precision, micro.input_ids.device):
                v, m = step_values(self.model.cumulative(micro, micro.value_ref_logprobs), micro.step_ids)
            bce = ipvrm.balanced_value_bce(v / beta, micro.rewards.float(), shift[idx], weight[idx])
            loss = (bce * m)[:, 1:].sum() / max(boundaries, 1.0) * (1.0 if real else 0.0)  # a stand-in adds 0
            scaler.scale_loss(loss).backward()
            total += loss.detach().item()
        self.model.policy.eval()
        total = distributed.all_sum({"bce": total})["bce"]
        grad_norm = optimizer_step(self.online, scaler)  # None: skipped for non-finite gradients
        self.online.optimizer.zero_grad(set_to_none=True)  # φ's gradients are not held until its next step
        return {"value_bce": total, "value_boundaries": boundaries,
                **({"value_grad_norm": grad_norm} if grad_norm is not None else {})}

    def install(self, source: ValueSource) -> None:
        """Replace the frozen value model by the one at `source` (a refreshed one), checking its provenance."""
        if self.online is not None:
            raise ValueError(f"cannot replace the value model by {source.path}: this run trains its value model "
                             "online (method.caspo.online=true), and a refreshed model needs a frozen run")
        # on the CPU (a skeleton on ranks other than 0): only its weights' identity is read, by rank 0
        label_policy = load_policy(source.label_policy, fsdp.read_device("cpu"))
        self.model = load_value_model(self.cfg, self.tokenizer, source, label_policy, self.device)
        if distributed.active():
            self.shard(self.cfg.train.precision)
        gc.collect()  # the model replaced, and a sharded one's whole weights, sit in reference cycles
        self.source = source
        self.shares_reference = shares_reference(self.cfg, source, self.model)

    def state_dict(self) -> dict:
        return {"value_source": {"path": self.source.path, "label_policy": self.source.label_policy}}

    def load_state_dict(self, tr: "Trainer", state: dict) -> None:
        """Continue with the value model the checkpoint trained with (after a refresh, the refreshed one),
        unless this run's config names another model than the checkpoint's run did."""
        recorded = state.get("value_source")
        if recorded is None:  # written before value sources were recorded: the configured model, already loaded
            return
        recorded = ValueSource(**recorded)
        if recorded == self.source:
            return
        if state["config"]["method"]["caspo"]["value_model"] != self.cfg.method.caspo.value_model:
            if self.online is not None:  # the checkpoint's φ weights would load into another model's reference
                raise ConfigError(f"the checkpoint trained its value model online from {recorded.path}; "
                                  f"method.caspo.value_model={self.source.path} cannot continue it: resume with "
                                  "the run's own value_model, or start a new run")
            console.print(f"value model: {self.source.path}, as configured (the checkpoint trained with "
                          f"{recorded.path})")
            return
        self.install(recorded)
        console.print(f"value model: {recorded.path}, as the checkpoint trained with")


def shuffled_within_batch(values: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """The valid entries of `values` permuted among themselves (a control that keeps their distribution)."""
    valid = mask.bool()
    g = torch.Generator().manual_seed(seed)
    out = values.clone()
    out[valid] = values[valid][torch.randperm(int(valid.sum()), generator=g).to(values.device)]
    return out
