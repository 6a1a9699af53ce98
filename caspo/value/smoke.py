"""The smoke gate of a prefix value model: one CASPO rollout batch, V of each whole response against its outcome.

The seed's phase 1 ends by validating a freshly trained value model on a 1-step CASPO
rollout, passing it when v_acc ≥ 0.7, and warns that v_acc must be read against the
majority baseline and ROC-AUC (`caspo.value.metrics.outcome_gate`). The batch is the one
the first RL step of this config would train on: same prompts, seeds, sampler and verifier.
"""

from __future__ import annotations

import torch

from caspo.batch import RolloutBatch
from caspo.config import Config
from caspo.models.prefix_value import PrefixValueModel
from caspo.runlog import console
from caspo.train.loop import generate, reward
from caspo.train.trainer import build_trainer
from caspo.value.metrics import outcome_gate

V_ACC_GATE = 0.7  # the seed: "passes if v_acc >= 0.7"


@torch.no_grad()
def final_values(model: PrefixValueModel, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor:
    """[B] V of each whole response: C[L − 1] of its cumulative values, 0 for an empty response."""
    out = torch.zeros(batch.size)
    for idx, micro in batch.micro_batches(micro_batch_size):
        cumulative = model.cumulative(micro)
        lengths = micro.response_lengths
        last = cumulative.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        out[idx] = torch.where(lengths > 0, last, torch.zeros_like(last)).float().cpu()
    return out


def smoke_gate(cfg: Config, threshold: float = V_ACC_GATE) -> dict:
    """`outcome_gate` of method.caspo.value_model on the first rollout batch of `cfg` (a caspo config)."""
    if cfg.method.name != "caspo":
        raise ValueError(f"the smoke gate reads CASPO's value model: set method.name=caspo (got {cfg.method.name}) "
                         "and method.caspo.value_model=PATH")
    tr = build_trainer(cfg)
    with tr.pool:
        batch = generate(tr, tr.cursor.take(cfg.rollout.prompts_per_step))
        batch.rewards = reward(tr, batch)
    model = tr.method_state.model
    values = final_values(model, batch, cfg.train.micro_batch_size)
    report = {"value_model": cfg.method.caspo.value_model,
              **outcome_gate(values.numpy(), batch.rewards.cpu().numpy(), model.beta, threshold)}
    verdict = "passes" if report["passed"] else "fails"
    console.print(f"smoke gate {verdict}: v_acc {report['v_acc']:.3f} (gate {threshold:g}), majority baseline "
                  f"{report['majority_baseline']:.3f}, AUC {report['auc']:.3f}, {report['n']} responses")
    if report["passed"] and not report["beats_majority"]:
        console.print("  v_acc does not beat always guessing the common outcome: the value model may carry no "
                      "signal; read the AUC")
    return report
