"""The method table: each method is one row naming its credit signal and its loss.

A method is data, not a subclass: the outer step reads the row to decide which
phases run (value estimation, reference scores) and which pure functions of
`caspo.algo` turn rewards into advantages and advantages into a loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    advantage: str  # "group": group-relative terminal reward
    loss: str  # "ppo_clip": clipped surrogate on recomputed old log-probs
    group_baseline: bool  # needs G >= 2 samples per prompt
    needs_critic: bool = False
    doc: str = ""


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("grpo", advantage="group", loss="ppo_clip", group_baseline=True,
               doc="group-relative terminal reward (DeepSeekMath); no second batch-wide whitening"),
    ]
}
