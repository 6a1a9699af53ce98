"""Datasets (shipped benchmarks, files, `datasets`, arith), prompt templates, prompt encoding and the
resumable prompt stream."""

from caspo.data.cursor import PromptCursor
from caspo.data.examples import DataError, Example, InvalidRow, LoadResult, arith_examples
from caspo.data.load import load_jsonl, load_source
from caspo.data.prompts import encode_prompts
from caspo.data.registry import NAMES, SHIPPED, Benchmark
from caspo.data.tasks.arith import ArithProblem, ArithSpec, ArithTask, Step
from caspo.data.templates import TEMPLATES, render_prompt

__all__ = [
    "ArithProblem", "ArithSpec", "ArithTask", "Benchmark", "DataError", "Example", "InvalidRow", "LoadResult",
    "NAMES", "PromptCursor", "SHIPPED", "Step", "TEMPLATES", "arith_examples", "encode_prompts", "load_jsonl",
    "load_source", "render_prompt",
]
