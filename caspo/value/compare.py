"""CASPO's step advantages against VinePPO's on the same batch.

One rollout batch of the preset; its responses split into steps once; step values
from the prefix value model (CASPO) and from K Monte Carlo continuations (VinePPO);
both turned into step advantages by the same `step_advantages`; then the correlation
over all valid steps. A value model that tracks the Monte Carlo values gives step
credit that agrees with VinePPO's at a fraction of the cost.
"""

from __future__ import annotations

import numpy as np

from caspo.config import Config
from caspo.methods import METHODS
from caspo.train import step_values
from caspo.train.advantages import step_advantages
from caspo.train.loop import generate, reward
from caspo.train.timers import PhaseTimer
from caspo.train.trainer import build_trainer
from caspo.value.metrics import spearman


def compare_step_advantages(cfg: Config) -> dict:
    """`cfg` must be a caspo config (method.name=caspo with its value model)."""
    tr = build_trainer(cfg)
    timer = PhaseTimer()
    with tr.pool:
        batch = generate(tr, tr.cursor.take(cfg.rollout.prompts_per_step))
        batch.rewards = reward(tr, batch)
        step_ids = step_values.segment(tr, batch)
        advantages = {}
        for name, source in (("caspo", step_values.prefix_model_values),
                             ("vineppo", step_values.monte_carlo_values)):
            with timer(f"t_{name}"):
                values, mask, stats = source(tr, batch, step_ids)
            batch.extras.update(step_ids=step_ids, step_values=values, step_mask=mask, beta=tr.value_model.beta)
            step_advantages(batch, batch.rewards, cfg, METHODS[name])
            advantages[name] = batch.extras["step_advantages"][mask.bool()].cpu().numpy()
    a, b = advantages["caspo"], advantages["vineppo"]
    return {
        "steps": int(len(a)), "responses": batch.size,
        "pearson": float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 else float("nan"),
        "spearman": spearman(a, b), "mc_tokens": stats.get("mc_tokens"), **timer.reset(),
    }
