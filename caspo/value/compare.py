"""CASPO's step advantages against VinePPO's on the same batch.

One rollout batch of the preset; its responses split into steps once; step values
from the prefix value model (CASPO) and from K Monte Carlo continuations (VinePPO);
each turned into step advantages by its method's advantage function; then the
correlation over all valid steps. A value model that tracks the Monte Carlo values
gives step credit that agrees with VinePPO's at a fraction of the cost.
"""

from __future__ import annotations

import numpy as np

from caspo.config import Config
from caspo.methods import METHODS
from caspo.train.loop import generate, reward
from caspo.train.step_values import MonteCarloValues
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
        rewards = batch.rewards[:, None]  # the step methods read the score R = Σ token rewards
        advantages, stats = {}, {}
        for name, state in (("caspo", tr.method_state), ("vineppo", MonteCarloValues())):
            with timer(f"t_{name}"):
                stats |= state.values(tr, batch)
            METHODS[name].advantages(batch, rewards, cfg.method)
            advantages[name] = batch.step_advantages[batch.step_mask.bool()].cpu().numpy()
    a, b = advantages["caspo"], advantages["vineppo"]
    return {
        "steps": int(len(a)), "responses": batch.size,
        "pearson": float(np.corrcoef(a, b)[0, 1]) if len(a) > 1 else float("nan"),
        "spearman": spearman(a, b), "mc_tokens": stats.get("mc_tokens"), **timer.reset(),
    }
