"""Examples (query + verifiable label) and the loaders that build them.

Every row is validated when it is loaded, so a bad label fails here, with its file and line,
instead of showing up as a silent zero reward hours into training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from caspo.data.tasks.arith import ArithTask

SKIP_HINT = "or set data.skip_invalid=true to skip such rows"


class DataError(ValueError):
    """A dataset file or row that cannot be used."""


@dataclass(frozen=True)
class Example:
    id: str
    query: str
    label: str  # the reference final answer, as the verifier reads it
    meta: dict = field(default_factory=dict)  # the row's other fields (solution, source, ...)


@dataclass
class LoadResult:
    examples: list[Example]
    skipped: int  # rows dropped under skip_invalid
    problems: list[str]  # one message per skipped row, for the caller to log


def load_jsonl(path, *, query_field: str = "problem", label_field: str = "answer",
               id_field: str | None = None, skip_invalid: bool = False) -> LoadResult:
    """Load and validate a JSONL file of {query_field: str, label_field: str|int, ...} rows.

    Ids are `row[id_field]`, or `{file_stem}-{line}` when id_field is None. A bad row raises
    DataError naming `file:line:field`, unless skip_invalid, which drops and reports it.
    Blank lines are ignored.
    """
    from caspo.reward.verify import check_label  # imported here so that importing caspo.data stays light

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file; check the data path in the config")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e})") from e

    examples, problems, first_line_of = [], [], {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            example = _parse_row(line, f"{path}:{lineno}", query_field, label_field, id_field,
                                 default_id=f"{path.stem}-{lineno}", check_label=check_label)
            if example.id in first_line_of:
                raise DataError(f"{path}:{lineno}:{id_field or 'id'}: duplicate id {example.id!r} "
                                f"(first on line {first_line_of[example.id]}); make ids unique, {SKIP_HINT}")
        except DataError as e:
            if not skip_invalid:
                raise
            problems.append(str(e))
            continue
        first_line_of[example.id] = lineno
        examples.append(example)
    return LoadResult(examples, len(problems), problems)


def _parse_row(line, where, query_field, label_field, id_field, *, default_id, check_label) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}); fix the line, {SKIP_HINT}") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; fix the line, {SKIP_HINT}")

    def field_error(name, what, fix):
        return DataError(f"{where}:{name}: {what}; {fix}, {SKIP_HINT}")

    def require(name, setting):
        if name not in row:
            raise field_error(name, f"missing field (row has {sorted(row)})",
                              f"add it or point {setting} at the right field")
        return row[name]

    query = require(query_field, "data.query_field")
    if not isinstance(query, str) or not query.strip():
        raise field_error(query_field, f"query must be a non-empty string, got {query!r}", "fix the row")

    label = require(label_field, "data.label_field")
    if isinstance(label, int) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str) or not label.strip():
        raise field_error(label_field, f"label must be a non-empty string or an int, got {label!r}",
                          "write the answer as a string (e.g. \"0.5\")")
    try:
        check_label(label)
    except ValueError as e:
        raise field_error(label_field, f"rejected by the verifier: {e}",
                          "write the answer in a form the verifier reads") from None

    if id_field is None:
        id_ = default_id
    else:
        id_ = require(id_field, "data.id_field")
        if isinstance(id_, int) and not isinstance(id_, bool):
            id_ = str(id_)
        if not isinstance(id_, str) or not id_:
            raise field_error(id_field, f"id must be a non-empty string or an int, got {id_!r}", "fix the row")

    meta = {k: v for k, v in row.items() if k not in (query_field, label_field, id_field)}
    return Example(id_, query, label, meta)


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
