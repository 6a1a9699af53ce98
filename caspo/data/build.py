"""From the `data` section of a config to encoded training and evaluation prompts."""

from __future__ import annotations

from dataclasses import dataclass

from caspo.config import Config
from caspo.data.examples import Example, arith_examples, load_jsonl
from caspo.data.prompts import encode_prompts
from caspo.data.tasks.arith import ArithSpec, ArithTask
from caspo.data.templates import prompt_bos, render_prompt
from caspo.runlog import console


@dataclass
class TaskData:
    train: list[Example]
    train_prompts: list[list[int]]
    eval: list[Example]
    eval_prompts: list[list[int]]


def arith_task(cfg: Config) -> ArithTask:
    a = cfg.data.arith
    spec = ArithSpec(min_ops=a.min_ops, max_ops=a.max_ops, max_start=a.max_start, max_addend=a.max_addend,
                     mul_factors=tuple(a.mul_factors), max_value=a.max_value,
                     skip_last_prob=cfg.sft.skip_last_prob, skip_last_when=cfg.sft.skip_last_when,
                     slip_prob=cfg.sft.slip_prob)
    return ArithTask(spec, seed=a.seed, train_size=a.train_size, heldout_pool_size=a.heldout_pool_size)


def load_examples(cfg: Config, source: str, split: str, limit: int) -> list[Example]:
    d = cfg.data
    if source == "arith":
        task = arith_task(cfg)
        return arith_examples(task, split, min(limit, task.size(split)) if limit else task.size(split))
    result = load_jsonl(source, query_field=d.query_field, label_field=d.label_field, id_field=d.id_field,
                        skip_invalid=d.skip_invalid)
    if result.skipped:
        console.print(f"[yellow]{source}: skipped {result.skipped} invalid rows[/yellow]")
        for problem in result.problems[:5]:
            console.print(f"  {problem}")
    return result.examples[:limit] if limit else result.examples


def encode(cfg: Config, tokenizer, examples: list[Example]) -> list[list[int]]:
    """Rendered prompts (`chat`: through the tokenizer's chat template) as ids, with BOS as `data.add_bos` says."""
    d = cfg.data
    texts = [render_prompt(d.template, e.query, tokenizer) for e in examples]
    return encode_prompts(tokenizer, texts, add_bos=prompt_bos(d.add_bos, tokenizer, texts),
                          max_prompt_tokens=d.max_prompt_tokens)


def load_task_data(cfg: Config, tokenizer) -> TaskData:
    d = cfg.data
    train = load_examples(cfg, d.source, "train", d.train_size)
    eval_source = d.eval_source or d.source
    evals = load_examples(cfg, eval_source, "heldout", cfg.eval.heldout_size)
    if not train:
        raise ValueError(f"data.source={d.source!r} gave no training examples")
    return TaskData(train, encode(cfg, tokenizer, train), evals, encode(cfg, tokenizer, evals))
