"""Where rows come from: a source string parsed, and its raw rows read.

    dsr_sub, math500, gsm8k, ...     a benchmark shipped with caspo (caspo.data.registry)
    path/to/file.jsonl               one JSON object per line
    path/to/file.parquet             a parquet table (nested columns read as dicts)
    path/to/folder[@SPLIT]           a `datasets` folder: `save_to_disk` output, or data files `load_dataset` reads
    hf:NAME[:CONFIG][@SPLIT]         `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`: a hub dataset or a local path

A row that cannot be read (bad JSON, not an object) is returned as its error, so it is
counted with the other invalid rows instead of stopping the load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from caspo.data.examples import DataError
from caspo.data.registry import ARITH, NAMES, NOT_SHIPPED, SHIPPED

HF = "hf:"
FORMS = "a shipped name (" + ", ".join(NAMES) + "), a .jsonl or .parquet file, a datasets folder, or hf:NAME"


@dataclass(frozen=True)
class Source:
    kind: str  # arith | shipped | jsonl | parquet | datasets | hub
    target: str  # the name, path or dataset id
    config: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class RawRow:
    where: str  # file:line or source[index], for messages
    default_id: str  # the id when the row has no id field
    row: dict | None  # None when the row could not be read
    error: str = ""  # why it could not be read


def parse_source(source: str) -> Source:
    if source == ARITH:
        return Source("arith", source)
    if source in SHIPPED:
        return Source("shipped", source)
    if source in NOT_SHIPPED:
        raise DataError(NOT_SHIPPED[source])
    if source.startswith(HF):
        rest, _, split = source[len(HF):].partition("@")
        name, _, config = rest.partition(":")
        if not name:
            raise DataError(f"data source {source!r} names no dataset; write hf:NAME[:CONFIG][@SPLIT]")
        return Source("hub", name, config or None, split or None)
    base, _, split = source.rpartition("@") if "@" in source else (source, "", "")
    if Path(base).is_dir():
        return Source("datasets", base, None, split or None)
    suffix = Path(source).suffix
    if suffix in (".jsonl", ".parquet"):
        if not Path(source).is_file():
            raise DataError(f"{source}: no such data file; check the data path in the config")
        return Source(suffix[1:], source)
    raise DataError(f"unknown data source {source!r}: use {FORMS}")


LOCAL = ("jsonl", "parquet", "datasets")  # kinds whose target is a path on this machine


def same_source(a: str, b: str) -> bool:
    """Whether two source strings name the same rows: the same shipped name, hub dataset, or file or folder
    (by any path to it) with the same split."""
    x, y = parse_source(a), parse_source(b)
    if x.kind in LOCAL and y.kind in LOCAL:
        x, y = (replace(src, target=str(Path(src.target).resolve())) for src in (x, y))
    return x == y


def read_rows(src: Source) -> list[RawRow]:
    if src.kind == "shipped":
        return _jsonl(SHIPPED[src.target].path)
    if src.kind == "jsonl":
        return _jsonl(Path(src.target))
    if src.kind == "parquet":
        return _table(src.target, _parquet(src.target))
    if src.kind in ("datasets", "hub"):
        return _table(_label(src), _datasets(src))
    raise DataError(f"{src.target}: {src.kind} sources have no rows to read")


def _label(src: Source) -> str:
    text = (HF if src.kind == "hub" else "") + src.target + (f":{src.config}" if src.config else "")
    return text + (f"@{src.split}" if src.split else "")


def _jsonl(path: Path) -> list[RawRow]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of row 1
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e}); re-save the file as UTF-8") from None
    out = []
    for lineno, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        where, default_id = f"{path}:{lineno}", f"{path.stem}-{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            out.append(RawRow(where, default_id, None, f"invalid JSON ({e.msg})"))
            continue
        if not isinstance(row, dict):
            out.append(RawRow(where, default_id, None, f"expected a JSON object, got {type(row).__name__}"))
            continue
        out.append(RawRow(where, default_id, row))
    return out


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text, split at "\n" (a "\r" before it dropped) and nowhere else: str.splitlines
    would also split at U+2028, U+2029 and U+0085, which JSON allows raw inside a string."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _table(label: str, rows: list[dict]) -> list[RawRow]:
    stem = Path(label).stem if "/" in label or "." in label else label
    return [RawRow(f"{label}[{i}]", f"{stem}-{i}", row) for i, row in enumerate(rows)]


def _parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged or foreign file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e}); check the file") from None


def _datasets(src: Source) -> list[dict]:
    import datasets

    saved = src.kind == "datasets" and any((Path(src.target) / f).exists()
                                           for f in ("state.json", "dataset_dict.json"))
    try:
        if saved:
            data = datasets.load_from_disk(src.target)
        else:
            data = datasets.load_dataset(src.target, src.config, split=src.split)
    except Exception as e:  # datasets raises ConnectionError, FileNotFoundError, ValueError, ... by cause
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{_label(src)}: datasets could not load {src.target!r} ({type(e).__name__}: {first}); "
                        "check the name, config and split, and that the hub is reachable (HF_DATASETS_OFFLINE=1 "
                        "forbids it), or point data.source at local files") from None
    if isinstance(data, datasets.DatasetDict):
        splits = sorted(data)
        if src.split is None and len(splits) == 1:
            data = data[splits[0]]
        elif src.split in data:
            data = data[src.split]
        else:
            raise DataError(f"{_label(src)}: choose a split with @SPLIT, one of {splits}")
    return data.to_list()
