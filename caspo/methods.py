"""The method table: each method is one row naming its credit signal, its loss and its schedule.

A method is data, not a subclass: the outer step reads the row to decide which
phases run (critic values, proximal or frozen-old scores) and which pure functions
of `caspo.algo` turn rewards into advantages and advantages into a loss.

    advantage  group     group-relative terminal reward (s - mean_g) / std_g
               terminal  terminal reward standardised over batch | group | off
               gae       GAE on a learned critic's values
               step_td   A_k = r_k + V(s_{k+1}) − V(s_k) on step values (Monte Carlo or learned)
    loss       ppo_clip        clipped surrogate on trainer-recomputed old log-probs
               decoupled       clipped surrogate on r = π/π_prox, weighted by clamp(π_prox/μ)
               divergence_gate full-vocabulary KL(old‖new) gate, frozen old policy
               dppo_binary     Divergence-PPO binary TV / KL trust-region mask
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    advantage: str
    loss: str
    group_baseline: bool = False  # needs G >= 2 samples per prompt
    needs_critic: bool = False
    divergence: str = ""  # dppo_binary: "tv" | "kl"
    halves: bool = False
    step_values: str = ""  # step_td: "mc" (VinePPO) | "prefix" (CASPO's learned prefix values)  # two optimizer steps per rollout, each on half the completions
    doc: str = ""


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("grpo", "group", "ppo_clip", group_baseline=True,
               doc="group-relative terminal reward (DeepSeekMath); no second batch-wide whitening"),
        Method("ppo", "terminal", "ppo_clip",
               doc="PPO with the terminal reward standardised over batch, group or not at all"),
        Method("ppo_critic", "gae", "ppo_clip", needs_critic=True,
               doc="PPO with a learned scalar critic and GAE (Schulman et al. 2017)"),
        Method("dppo", "gae", "decoupled", needs_critic=True,
               doc="decoupled PPO: behaviour log-probs from the engine, proximal ones recomputed, bounded weight"),
        Method("flow_dppo", "gae", "divergence_gate", needs_critic=True, halves=True,
               doc="categorical divergence gate against frozen old-policy distributions; two steps on halves"),
        Method("vineppo", "step_td", "ppo_clip", step_values="mc",
               doc="VinePPO: step values = mean reward of K Monte Carlo continuations from each step boundary"),
        Method("caspo", "step_td", "ppo_clip", step_values="prefix",
               doc="step TD on values from a learned prefix value model (IPVRM-style), frozen or online"),
        Method("dppo_tv", "group", "dppo_binary", group_baseline=True, divergence="tv",
               doc="Divergence-PPO binary total-variation mask, group-relative advantages"),
        Method("dppo_kl", "group", "dppo_binary", group_baseline=True, divergence="kl",
               doc="Divergence-PPO binary KL mask, group-relative advantages"),
    ]
}

ALIASES = {"flow-dppo": "flow_dppo"}  # the looped recipe's spelling


def get_method(name: str) -> Method:
    return METHODS[ALIASES.get(name, name)]
