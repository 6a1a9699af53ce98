"""Step segmentation: text splitters -> character offsets -> token step ids."""

from caspo.segment.factory import batch_step_splitter, splitter_name, step_splitter
from caspo.segment.latex import latex_step_starts
from caspo.segment.newline import newline_step_starts
from caspo.segment.token_steps import (
    SPLITTERS,
    TokenSteps,
    char_offsets_from_tokens,
    final_box_end,
    merge_after_final_box,
    pad_step_ids,
    segment_response,
    segment_responses,
    token_step_ids,
)

__all__ = [
    "SPLITTERS",
    "TokenSteps",
    "batch_step_splitter",
    "char_offsets_from_tokens",
    "final_box_end",
    "latex_step_starts",
    "merge_after_final_box",
    "newline_step_starts",
    "pad_step_ids",
    "segment_response",
    "segment_responses",
    "splitter_name",
    "step_splitter",
    "token_step_ids",
]
