"""The problems of each benchmark an evaluation runs, loaded once and encoded with the run's template.

A benchmark is a shipped name (caspo.data.registry), `arith` (the task's held-out split), `heldout`
(the run's own held-out set: data.eval_source or data.heldout_fraction), or any data source
(a .jsonl / .parquet file, a datasets folder, hf:NAME), read with the run's data.*_field names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from caspo.config import Config
from caspo.data.build import fitting, load_examples
from caspo.data.examples import DataError, Example
from caspo.data.registry import ARITH, HELDOUT, SHIPPED
from caspo.data.task import task_examples


@dataclass
class Suite:
    name: str  # the key of its results
    source: str  # what was loaded
    examples: list[Example]
    prompts: list[list[int]]
    subject_field: str | None = None
    level_field: str | None = None
    load: dict = field(default_factory=dict)  # rows read, invalid and excluded rows (LoadResult.summary)


def suite_name(source: str) -> str:
    if source in SHIPPED or source in (ARITH, HELDOUT):
        return source
    if source.startswith("hf:"):
        return source[3:].replace("/", "-").replace(":", "-").replace("@", "-")
    base = source.rpartition("@")[0] if "@" in source else source
    return Path(base.rstrip("/")).stem


def load_suites(cfg: Config, tokenizer, sources: list[str]) -> list[Suite]:
    """Each benchmark's first eval.limit problems (0 = all), encoded; names must be distinct."""
    suites, seen = [], {}
    for source in sources:
        name = suite_name(source)
        if name in seen:
            raise DataError(f"benchmarks {seen[name]!r} and {source!r} share the name {name!r}; rename a file")
        seen[name] = source
        suites.append(load_suite(cfg, tokenizer, source, name))
    return suites


def load_suite(cfg: Config, tokenizer, source: str, name: str) -> Suite:
    """The benchmark's first eval.limit problems; with data.long_prompts=skip, those over data.max_prompt_tokens
    are then left out and counted (`load`: skipped_long), as the training prompts are."""
    limit, bench = cfg.eval.limit, SHIPPED.get(source)
    if source == HELDOUT:
        examples = task_examples(cfg).eval[:limit or None]
        if not examples:
            raise DataError("the heldout benchmark is empty: set data.eval_source or data.heldout_fraction")
        load = {"examples": len(examples)}
    else:
        result = load_examples(cfg, source, "heldout", limit)
        if not result.examples:
            raise DataError(f"benchmark {source!r} has no problems; check the source and eval.limit")
        examples, load = result.examples, result.summary()
    examples, prompts = fitting(cfg, tokenizer, examples, load)
    if not examples:
        raise DataError(f"every problem of benchmark {source!r} is over data.max_prompt_tokens="
                        f"{cfg.data.max_prompt_tokens} (data.long_prompts=skip); raise the limit")
    load["examples"] = len(examples)
    return Suite(name, source, examples, prompts, subject_field=bench.subject_field if bench else None,
                 level_field=bench.level_field if bench else None, load=load)
