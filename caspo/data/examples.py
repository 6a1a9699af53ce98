"""Examples (query + verifiable label), the result of loading a source, and the arithmetic task's examples."""

from __future__ import annotations

from dataclasses import dataclass, field

from caspo.data.tasks.arith import ArithTask

SKIP_HINT = "or set data.skip_invalid=true to skip such rows"
SHOWN = 5  # invalid rows named in a summary or an error


class DataError(ValueError):
    """A data source or row that cannot be used."""


@dataclass(frozen=True)
class Example:
    id: str
    query: str
    label: str  # the reference final answer, as the verifier reads it
    meta: dict = field(default_factory=dict)  # the row's other fields (solution, source, ...)


@dataclass(frozen=True)
class InvalidRow:
    id: str  # the row's id, or `<stem>-<line>` / `row <i>` when it has none
    where: str  # file:line or source[index]
    field: str  # the field at fault ("" for the row as a whole)
    what: str  # what is wrong

    def __str__(self) -> str:
        return f"{self.where}:{self.field}: {self.what}" if self.field else f"{self.where}: {self.what}"


@dataclass
class LoadResult:
    source: str
    examples: list[Example]
    rows: int = 0  # rows read (blank JSONL lines not counted)
    invalid: list[InvalidRow] = field(default_factory=list)  # rejected rows, skipped under data.skip_invalid
    excluded: list[InvalidRow] = field(default_factory=list)  # a shipped benchmark's known invalid rows
    stale: list[str] = field(default_factory=list)  # known-invalid ids that now load: the list needs updating

    @property
    def skipped(self) -> int:
        return len(self.invalid)

    @property
    def problems(self) -> list[str]:
        return [str(r) for r in self.invalid]

    def summary(self) -> dict:
        """Counts and the first ids of the rows left out, for the run's data summary."""
        return {
            "source": self.source, "rows": self.rows, "examples": len(self.examples),
            "invalid": len(self.invalid), "invalid_first": [str(r) for r in self.invalid[:SHOWN]],
            "excluded": len(self.excluded), "excluded_ids": [r.id for r in self.excluded],
        }


def arith_examples(task: ArithTask, split: str, n: int) -> list[Example]:
    """The first n problems of an arithmetic split, as examples with the reference solution in meta."""
    if not 0 <= n <= task.size(split):
        raise ValueError(f"n={n} must be in [0, {task.size(split)}] for split {split!r}")
    examples = []
    for i in range(n):
        problem = task.problem(split, i)
        examples.append(Example(f"arith-{split}-{i}", problem.question, str(problem.answer),
                                {"solution": problem.solution, "split": split, "index": i}))
    return examples
