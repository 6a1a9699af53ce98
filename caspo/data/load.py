"""Rows of a source validated into examples.

Every row is checked when it is loaded (a non-empty query, a label the verifier accepts, a unique
id), so a bad label fails here instead of showing up as a silent zero reward hours into training.
Invalid rows are counted and named; they are skipped only under `skip_invalid`, otherwise the load
is an error naming their count, the first ones and the fix. A shipped benchmark's known invalid
rows (caspo.data.registry) are always left out and listed as excluded, a wrong gold too although
the verifier reads it.
"""

from __future__ import annotations

import functools

from caspo.data.examples import SHOWN, SKIP_HINT, DataError, Example, InvalidRow, LoadResult
from caspo.data.registry import SHIPPED, WRONG_GOLD
from caspo.data.rows import RawRow, parse_source, read_rows
from caspo.reward.extract import last_boxed

BOXED = "boxed:"  # data.label_field=boxed:FIELD reads the label off the last \boxed{} of FIELD


def load_source(source: str, *, query_field: str = "problem", label_field: str = "answer",
                id_field: str | None = None, skip_invalid: bool = False, limit: int = 0,
                max_answer_chars: int | None = None) -> LoadResult:
    """Examples of a shipped benchmark, file, datasets folder or hub dataset (forms: caspo.data.rows).

    A shipped benchmark brings its own field names. `limit` > 0 stops after that many examples. A label must
    be an answer the verifier can match within `max_answer_chars` (reward.max_answer_chars; None: its default).
    """
    src = parse_source(source)
    known: dict[str, str] = {}
    if src.kind == "shipped":
        bench = SHIPPED[source]
        query_field, label_field, id_field, known = bench.query_field, bench.label_field, bench.id_field, \
            bench.known_invalid
    return validate_rows(source, read_rows(src), query_field=query_field, label_field=label_field,
                         id_field=id_field, skip_invalid=skip_invalid, known_invalid=known, limit=limit,
                         max_answer_chars=max_answer_chars)


def load_jsonl(path, *, query_field: str = "problem", label_field: str = "answer",
               id_field: str | None = None, skip_invalid: bool = False) -> LoadResult:
    """A JSONL file's examples; ids are `row[id_field]`, or `{file_stem}-{line}` when id_field is None."""
    if not str(path).endswith(".jsonl"):
        raise DataError(f"{path}: expected a .jsonl file")
    return load_source(str(path), query_field=query_field, label_field=label_field, id_field=id_field,
                       skip_invalid=skip_invalid)


def validate_rows(source: str, raw: list[RawRow], *, query_field: str, label_field: str, id_field: str | None,
                  skip_invalid: bool, known_invalid: dict[str, str] | None = None, limit: int = 0,
                  max_answer_chars: int | None = None) -> LoadResult:

    known = known_invalid or {}
    result = LoadResult(source, [])
    first_of: dict[str, str] = {}
    for r in raw:
        if limit and len(result.examples) >= limit:
            break
        result.rows += 1
        example, bad = parse_row(r, query_field, label_field, id_field,
                                 functools.partial(checked_label, max_answer_chars=max_answer_chars))
        if bad is None and example.id in first_of:
            bad = InvalidRow(example.id, r.where, id_field or "id", f"duplicate id (first at {first_of[example.id]})")
        if bad is None and known.get(example.id, "").startswith(WRONG_GOLD):  # readable, but not the answer
            bad = InvalidRow(example.id, r.where, label_field, known[example.id])
        if bad is not None:
            (result.excluded if bad.id in known else result.invalid).append(bad)
            continue
        if example.id in known:
            result.stale.append(example.id)
        first_of[example.id] = r.where
        result.examples.append(example)
    if result.invalid and not skip_invalid:
        raise DataError(invalid_message(result))
    return result


def invalid_message(result: LoadResult) -> str:
    n, bad = len(result.invalid), result.invalid
    ids = ", ".join(r.id for r in bad[:SHOWN]) + (", ..." if n > SHOWN else "")
    return (f"{result.source}: {n} invalid row{'s' if n > 1 else ''} of {result.rows} ({ids}); first: {bad[0]}; "
            f"fix the rows or the field names (data.query_field / data.label_field / data.id_field), {SKIP_HINT}")


@functools.lru_cache(maxsize=None)
def checked_label(label: str, max_answer_chars: int | None = None) -> None:
    """`check_label`, once per distinct label and limit in a process: benchmarks load again at every
    checkpoint and the check parses every gold (a label it rejects raises, which is not cached)."""
    from caspo.reward.verify import check_label  # imported here so that importing caspo.data stays light

    if max_answer_chars is None:
        check_label(label)
    else:
        check_label(label, max_answer_chars)


def parse_row(r: RawRow, query_field: str, label_field: str, id_field: str | None,
              check_label) -> tuple[Example | None, InvalidRow | None]:
    """The row's example, or why it is invalid."""
    if r.row is None:
        return None, InvalidRow(r.default_id, r.where, "", r.error)
    row = r.row
    id_ = r.default_id
    if id_field is not None:
        id_ = field_value(row, id_field)
        if isinstance(id_, int) and not isinstance(id_, bool):
            id_ = str(id_)
        if not isinstance(id_, str) or not id_:
            what = "missing field" if id_ is MISSING else f"id must be a non-empty string or an int, got {id_!r}"
            return None, InvalidRow(r.default_id, r.where, id_field, what + _fields(row))

    def bad(name: str, what: str):
        return None, InvalidRow(id_, r.where, name, what)

    query = field_value(row, query_field)
    if query is MISSING:
        return bad(query_field, "missing field" + _fields(row))
    if not isinstance(query, str) or not query.strip():
        return bad(query_field, f"query must be a non-empty string, got {query!r}")
    boxed = label_field.startswith(BOXED)  # "boxed:solution": the last \boxed{} of a worked solution (MATH)
    label = field_value(row, label_field.removeprefix(BOXED))
    if label is MISSING:
        return bad(label_field, "missing field" + _fields(row))
    if boxed and isinstance(label, str):
        label = last_boxed(label)
        if label is None:
            return bad(label_field, "the solution has no complete \\boxed{} answer")
    if isinstance(label, int) and not isinstance(label, bool):
        label = str(label)
    if not isinstance(label, str) or not label.strip():
        return bad(label_field, f"label must be a non-empty string or an int, got {label!r}")
    try:
        check_label(label)
    except ValueError as e:
        return bad(label_field, f"rejected by the verifier: {e}")
    used = {query_field, label_field.removeprefix(BOXED), id_field}
    return Example(id_, query, label, {k: v for k, v in row.items() if k not in used}), None


MISSING = object()


def field_value(row: dict, name: str):
    """row[name], or a nested value by a dotted path ("reward_model.ground_truth"), or MISSING."""
    if name in row:
        return row[name]
    node = row
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _fields(row: dict) -> str:
    return f" (row has {sorted(row)})"
