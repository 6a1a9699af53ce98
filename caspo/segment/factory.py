"""The step splitter of a run, read off its config: training and phase 1 split responses alike."""

from __future__ import annotations

from typing import Callable, Sequence

from caspo.config import Config
from caspo.segment.token_steps import Decode, DecodeMany, segment_response, segment_responses


def splitter_name(cfg: Config) -> str:
    """method.step_splitter; "auto" is one computation per line for the arithmetic task, LaTeX-aware otherwise."""
    s = cfg.method.step_splitter
    return s if s != "auto" else ("newline" if cfg.data.source == "arith" else "latex")


def splitter_options(cfg: Config) -> dict:
    """segment_response's options, as method.step_splitter / max_steps / after_final_box say."""
    m = cfg.method
    return {"splitter": splitter_name(cfg), "max_steps": m.max_steps or None, "after_final_box": m.after_final_box}


def step_splitter(cfg: Config, decode: Decode) -> Callable[[Sequence[int]], list[int]]:
    """response token ids -> the step id of every token."""
    options = splitter_options(cfg)
    return lambda token_ids: segment_response(decode, token_ids, **options).token_step_ids


def batch_step_splitter(cfg: Config, decode: Decode, decode_many: DecodeMany,
                        concatenative: bool = False) -> Callable[[Sequence[Sequence[int]]], list[list[int]]]:
    """step_splitter over a batch of responses, equal to it row by row, decoding in batch calls
    (segment_responses; `decode_many` and `concatenative` as caspo.models.tokenizer.batch_decoder gives them)."""
    options = splitter_options(cfg)
    return lambda responses: [s.token_step_ids for s in segment_responses(decode, decode_many, responses,
                                                                            concatenative, **options)]
