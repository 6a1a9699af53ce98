"""Training prompts that are also evaluation problems: of the run's held-out set, and of each benchmark the run
evaluates at its checkpoints (eval.benchmarks).

Prompts are compared by a key that ignores case, spacing and LaTeX markup (`problem_key`), so that one problem
copied into two datasets with different spacing (`a^3 + b^3` and `a^{3}+b^{3}`) still counts as one.
"""

from __future__ import annotations

import re
from typing import Callable

from caspo.config import Config
from caspo.data.examples import Example
from caspo.data.load import field_value
from caspo.data.registry import ARITH, HELDOUT, SHIPPED
from caspo.data.rows import parse_source, read_rows

# Letters and digits, and the signs that change a problem's meaning (arccos(-1) is not arccos 1)
KEPT = re.compile(r"[^0-9a-z+\-=<>]")


def problem_key(text: str) -> str:
    return KEPT.sub("", text.lower())


def shared_prompts(train: list[Example], other: list[str]) -> int:
    """How many distinct training prompts are also among the `other` problem texts."""
    return len({problem_key(e.query) for e in train} & {problem_key(text) for text in other})


def benchmark_problems(cfg: Config, source: str, arith_heldout: Callable[[], list[str]]) -> list[str]:
    """The problem texts of a benchmark's first eval.limit rows (0 = all), without validating the rows:
    a shipped file less its known invalid rows, arith's held-out split (`arith_heldout()`), or a data
    source's query field."""
    limit = cfg.eval.limit or None
    if source == ARITH:
        return arith_heldout()[:limit]
    bench = SHIPPED.get(source)
    query_field = bench.query_field if bench else cfg.data.query_field
    left_out = set(bench.known_invalid) if bench else set()
    texts = []
    for raw in read_rows(parse_source(source)):
        row = raw.row or {}
        if bench and field_value(row, bench.id_field) in left_out:
            continue
        query = field_value(row, query_field)
        if isinstance(query, str) and query.strip():
            texts.append(query)
    return texts[:limit]


def benchmark_overlap(cfg: Config, train: list[Example], arith_heldout: Callable[[], list[str]]) -> dict[str, int]:
    """For each benchmark of eval.benchmarks, how many distinct training prompts are its problems (`heldout`,
    the run's own held-out set, is counted by the summary's `overlap`)."""
    return {name: shared_prompts(train, benchmark_problems(cfg, name, arith_heldout))
            for name in cfg.eval.benchmarks if name != HELDOUT}
