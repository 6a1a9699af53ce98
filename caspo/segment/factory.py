"""The step splitter of a run, read off its config: training and phase 1 split responses alike."""

from __future__ import annotations

from typing import Callable, Sequence

from caspo.config import Config
from caspo.segment.token_steps import Decode, segment_response


def splitter_name(cfg: Config) -> str:
    """method.step_splitter; "auto" is one computation per line for the arithmetic task, LaTeX-aware otherwise."""
    s = cfg.method.step_splitter
    return s if s != "auto" else ("newline" if cfg.data.source == "arith" else "latex")


def step_splitter(cfg: Config, decode: Decode) -> Callable[[Sequence[int]], list[int]]:
    """response token ids -> the step id of every token, as method.step_splitter / max_steps / after_final_box say."""
    m, name = cfg.method, splitter_name(cfg)

    def split(token_ids: Sequence[int]) -> list[int]:
        return segment_response(decode, token_ids, splitter=name, max_steps=m.max_steps or None,
                                after_final_box=m.after_final_box).token_step_ids
    return split
