"""Is ``caspo.train.monte_carlo`` an unbiased estimator? Two checks against the real policy.

1. Calibration of V(prompt). For n held-out prompts, V_i (K continuations through
   ``estimate_prefixes``) is compared with q_i, the success rate of M independent
   samples drawn straight from the engine with other seeds:

       z_i = (V_i − q_i) / sqrt(p̄_i (1 − p̄_i) (1/K + 1/M)),   p̄_i = (K·V_i + M·q_i) / (K + M).

   Under unbiasedness each z_i has mean 0 and variance about 1, so the mean of n of
   them should satisfy |mean z| < 3/√n. Prompts where all K + M outcomes agree have
   no z (0/0) and are left out of n; they are counted.
2. A planted wrong prefix. For each of the first `planted` prompts, the response "first reference line with a
   wrong result, then the box" goes through ``mc_step_values``; V after that first line
   should be near 0, since every later line builds on the wrong number.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from caspo.config import Config, ConfigError
from caspo.data.build import load_task_data
from caspo.reward.pool import RewardPool
from caspo.rollout.base import Request
from caspo.rollout.sampling import sample_seed
from caspo.runlog import console
from caspo.segment import segment_response
from caspo.train.monte_carlo import Prefix, continuation_seed, estimate_prefixes, mc_step_values, step_start_indices
from caspo.value.rollout import rollout_setup

# the `step` of this check's seeds: apart from training's (≥ 0) and phase 1's (−1); the refresh after step 1
# also uses −2, on training prompts' interior prefixes, where this check continues held-out prompts alone
CHECK_STEP = -2


def z_scores(v: list[float], q: list[float], k: int, m: int) -> list[float | None]:
    """z_i of the module docstring; None where the pooled rate is 0 or 1."""
    out = []
    for vi, qi in zip(v, q):
        pooled = (k * vi + m * qi) / (k + m)
        var = pooled * (1 - pooled) * (1 / k + 1 / m)
        out.append((vi - qi) / math.sqrt(var) if var > 0 else None)
    return out


def planted_line(solution: str) -> str:
    """The solution's first line "a op b = r" with r replaced by r + 1."""
    first = solution.split("\n")[0]
    lhs, result = first.rsplit("= ", 1)
    return f"{lhs}= {int(result) + 1}"


def run_check(cfg: Config, prompts: int, k: int = 9, m: int = 64, planted: int = 50) -> dict:
    """Both checks on the first ``prompts`` held-out prompts (the planted one on the first ``planted``)."""
    if cfg.data.source != "arith":
        raise ConfigError("the planted-prefix check builds wrong lines of the arithmetic task; use data.source=arith")
    if prompts > cfg.eval.heldout_size:
        raise ConfigError(f"{prompts} prompts asked for, eval.heldout_size gives {cfg.eval.heldout_size}; "
                          f"raise eval.heldout_size or ask for fewer")
    t0 = time.monotonic()
    setup = rollout_setup(cfg)
    engine, sampling, decode, tokenizer = setup.engine, setup.sampling, setup.decode, setup.tokenizer
    r, seed = cfg.rollout, cfg.train.seed
    data = load_task_data(cfg, tokenizer)
    if prompts > len(data.eval):  # prompts longer than the prompt budget are dropped
        raise ConfigError(f"{prompts} prompts asked for, {len(data.eval)} held-out prompts fit the prompt budget")
    prompt_ids, labels = data.eval_prompts[:prompts], [e.label for e in data.eval[:prompts]]

    with RewardPool.from_config(cfg.reward) as pool:
        scorer = setup.scorer(pool)
        seed_fn = partial(continuation_seed, seed, CHECK_STEP)
        est = estimate_prefixes(engine, [Prefix(tuple(p), (), lab) for p, lab in zip(prompt_ids, labels)], k=k,
                                sampling=sampling, max_new_tokens=r.max_new_tokens, seed_fn=seed_fn,
                                scorer=scorer, decode=decode)
        requests = [Request(p, sample_seed(seed + 1, CHECK_STEP, i, j), r.max_new_tokens)
                    for i, p in enumerate(prompt_ids) for j in range(m)]
        completions = engine.generate(requests, sampling)
        rewards = scorer([decode(c.tokens) for c in completions], [lab for lab in labels for _ in range(m)],
                         [c.finish_reason == "stop" for c in completions])
        q = [sum(rewards[i * m:(i + 1) * m]) / m for i in range(prompts)]

        planted = min(planted, prompts)
        responses = [tokenizer.encode(planted_line(e.meta["solution"]) + f"\n\\boxed{{{e.label}}}",
                                      add_special_tokens=False) for e in data.eval[:planted]]
        starts = [step_start_indices(segment_response(decode, t, "newline").token_step_ids) for t in responses]
        mc = mc_step_values(engine, prompt_ids[:planted], responses, starts, labels[:planted], k=k,
                            sampling=sampling, max_new_tokens=r.max_new_tokens, seed_fn=seed_fn, scorer=scorer,
                            decode=decode)

    z = [zi for zi in z_scores(est.means, q, k, m) if zi is not None]
    n = len(z)
    mean_z = sum(z) / n if n else math.nan
    after_wrong = mc.values[:, 1].tolist()
    report = {
        "prompts": prompts, "k": k, "m": m, "n_with_z": n, "degenerate_prompts": prompts - n,
        "mean_z": mean_z, "bound_3_over_sqrt_n": 3 / math.sqrt(n) if n else math.nan,
        "var_z": sum((zi - mean_z) ** 2 for zi in z) / (n - 1) if n > 1 else math.nan,
        "calibration_passed": n >= 1 and abs(mean_z) < 3 / math.sqrt(n),
        "mean_v_prompt": sum(est.means) / prompts, "mean_q_prompt": sum(q) / prompts,
        "planted_prompts": planted,
        "planted_mean_v_prompt": mc.values[:, 0].mean().item(),
        "planted_mean_v_after_wrong_line": sum(after_wrong) / planted,
        "planted_frac_exactly_zero": sum(v == 0 for v in after_wrong) / planted,
        "planted_v_prompt_matches": bool(torch.equal(mc.values[:, 0], torch.tensor(est.means[:planted]))),
        "mc_tokens": est.tokens + mc.mc_tokens, "seconds": round(time.monotonic() - t0, 1),
        **scorer.unscored.counts("mc_reward_"),  # samples scored 0 without a verdict
    }
    console.print(report)
    return report
