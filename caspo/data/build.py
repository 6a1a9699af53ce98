"""From the `data` section of a config to encoded training and evaluation prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from caspo.config import Config
from caspo.data.examples import Example
from caspo.data.prompts import encode_prompts
from caspo.data.task import arith_task, load_examples, task_examples
from caspo.data.templates import prompt_bos, render_prompt

__all__ = ["TaskData", "arith_task", "encode", "load_examples", "load_task_data"]


@dataclass
class TaskData:
    train: list[Example]
    train_prompts: list[list[int]]
    eval: list[Example]
    eval_prompts: list[list[int]]
    summary: dict = field(default_factory=dict)  # caspo.data.task.task_examples: sources, counts, left-out rows


def encode(cfg: Config, tokenizer, examples: list[Example]) -> list[list[int]]:
    """Rendered prompts (`chat`: through the tokenizer's chat template) as ids, with BOS as `data.add_bos` says."""
    d = cfg.data
    texts = [render_prompt(d.template, e.query, tokenizer) for e in examples]
    return encode_prompts(tokenizer, texts, add_bos=prompt_bos(d.add_bos, tokenizer, texts),
                          max_prompt_tokens=d.max_prompt_tokens)


def load_task_data(cfg: Config, tokenizer) -> TaskData:
    ex = task_examples(cfg)
    return TaskData(ex.train, encode(cfg, tokenizer, ex.train), ex.eval, encode(cfg, tokenizer, ex.eval), ex.summary)
