"""From the `data` section of a config to encoded training and evaluation prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from caspo.config import Config
from caspo.data.examples import SHOWN, DataError, Example
from caspo.data.prompts import encode_prompts
from caspo.data.task import arith_task, load_examples, skipped_long_note, summarize_use, task_examples
from caspo.data.templates import prompt_bos, render_prompt
from caspo.runlog import console

LIMITLESS = 1 << 30  # data.long_prompts=skip: encode every prompt, then leave out the long ones

__all__ = ["TaskData", "arith_task", "encode", "load_examples", "load_task_data"]


@dataclass
class TaskData:
    train: list[Example]
    train_prompts: list[list[int]]
    eval: list[Example]
    eval_prompts: list[list[int]]
    summary: dict = field(default_factory=dict)  # caspo.data.task.task_examples: sources, counts, left-out rows


def encode(cfg: Config, tokenizer, examples: list[Example]) -> list[list[int]]:
    """Rendered prompts (`chat`: through the tokenizer's chat template) as ids, with BOS as `data.add_bos` says;
    a prompt over data.max_prompt_tokens is an error, or with data.long_prompts=truncate_left keeps its end."""
    d = cfg.data
    texts = [render_prompt(d.template, e.query, tokenizer) for e in examples]
    overflow = "truncate_left" if d.long_prompts == "truncate_left" else "error"
    limit = d.max_prompt_tokens if d.long_prompts != "skip" else LIMITLESS
    return encode_prompts(tokenizer, texts, add_bos=prompt_bos(d.add_bos, tokenizer, texts),
                          max_prompt_tokens=limit, on_overflow=overflow, ids=[e.id for e in examples])


def fitting(cfg: Config, tokenizer, examples: list[Example], summary: dict,
            announce: bool = True) -> tuple[list[Example], list]:
    """The examples and their prompt ids; with data.long_prompts=skip, those over data.max_prompt_tokens are
    left out, counted in `summary` (skipped_long, skipped_long_ids) and, with `announce`, printed."""
    prompts = encode(cfg, tokenizer, examples)
    if cfg.data.long_prompts != "skip":
        return examples, prompts
    keep = [i for i, ids in enumerate(prompts) if len(ids) <= cfg.data.max_prompt_tokens]
    long = [examples[i].id for i in range(len(examples)) if len(prompts[i]) > cfg.data.max_prompt_tokens]
    if long:
        summary.update(skipped_long=len(long), skipped_long_ids=long[:SHOWN])
    if long and announce:
        console.print(skipped_long_note(cfg, len(long), long[:SHOWN]))
    return [examples[i] for i in keep], [prompts[i] for i in keep]


def load_task_data(cfg: Config, tokenizer) -> TaskData:
    """The run's examples and prompts; its summary counts the examples it trains on and evaluates, after
    data.long_prompts=skip left out the long ones."""
    ex = task_examples(cfg, summarize=False)
    train, train_prompts = fitting(cfg, tokenizer, ex.train, ex.summary["train"], announce=False)
    held, held_prompts = fitting(cfg, tokenizer, ex.eval, ex.summary["heldout"], announce=False)
    if not train:
        raise DataError(f"every training prompt is over data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    summarize_use(cfg, ex.summary, train, held)
    check_batch_fits(cfg, len(train))
    return TaskData(train, train_prompts, held, held_prompts, ex.summary)


def check_batch_fits(cfg: Config, train_examples: int) -> None:
    """A step's prompts are distinct only if there are at least as many training examples (a step that crosses
    the end of a pass may still repeat a prompt of the pass before: docs/data.md)."""
    per_step = cfg.rollout.prompts_per_step
    if per_step > train_examples:
        raise DataError(f"rollout.prompts_per_step={per_step} is more than the {train_examples} training examples, so "
                        f"every step would repeat prompts: set rollout.prompts_per_step <= {train_examples}, or train "
                        "on more examples (data.train_size, data.source, data.max_prompt_tokens)")
