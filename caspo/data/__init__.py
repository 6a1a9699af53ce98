"""Datasets, prompt templates, prompt encoding and the resumable prompt stream."""

from caspo.data.cursor import PromptCursor
from caspo.data.examples import DataError, Example, LoadResult, arith_examples, load_jsonl
from caspo.data.prompts import encode_prompts
from caspo.data.tasks.arith import ArithProblem, ArithSpec, ArithTask, Step
from caspo.data.templates import TEMPLATES, render_prompt

__all__ = [
    "ArithProblem", "ArithSpec", "ArithTask", "DataError", "Example", "LoadResult", "PromptCursor",
    "Step", "TEMPLATES", "arith_examples", "encode_prompts", "load_jsonl", "render_prompt",
]
