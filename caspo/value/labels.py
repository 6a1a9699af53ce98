"""Monte Carlo label files: JSONL, one header line, then one row per labelled prefix.

    {"header": {"format": ..., "shard": "0/4", "k": 8, "j": 8, ..., "provenance": {...}}}
    {"prompt_id": ..., "prompt_tokens": [...], "response_tokens": [...], "boundary": 12, "p_hat": 0.375, ...}

A row labels the prefix ``response_tokens[:boundary]`` of one base rollout with p̂, the
mean 0/1 reward of J continuations from it. The header says how the file was made, so
``merge_label_files`` can refuse shards of different collections or a missing shard.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from caspo.models.provenance import Provenance

FORMAT = "caspo-value-labels/1"


class LabelFileError(ValueError):
    """A label file that cannot be used, with the file and the reason."""


@dataclass
class LabelRow:
    prompt_id: str
    prompt_index: int  # index of the prompt in the training split
    sample: int  # which of the K base rollouts of the prompt
    prompt_tokens: list[int]
    response_tokens: list[int]
    boundary: int  # the labelled prefix is response_tokens[:boundary]
    step: int  # index of the step that starts at `boundary`
    p_hat: float  # mean reward of the J continuations
    j: int
    base_reward: float  # final reward of the base rollout itself
    label: str  # the gold answer
    provenance: dict

    @property
    def response_key(self) -> tuple[int, int]:
        return self.prompt_index, self.sample


@dataclass
class LabelFile:
    header: dict
    rows: list[LabelRow]

    @property
    def provenance(self) -> Provenance:
        return Provenance.from_dict(self.header["provenance"])


@dataclass
class ResponseLabels:
    """All labelled prefixes of one base rollout: one forward of the value model reads them all."""

    prompt_id: str
    prompt_tokens: list[int]
    response_tokens: list[int]
    base_reward: float
    boundaries: list[int] = field(default_factory=list)
    p_hats: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # indices into the row list they came from
    weight: int = 1  # base rollouts this entry stands for (``merge_duplicates``)
    duplicate_rows: list[list[int]] = field(default_factory=list)  # `rows` of the other copies, boundary order


def write_label_file(path: str | Path, header: dict, rows: Sequence[LabelRow]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps({"header": {"format": FORMAT, **header, "rows": len(rows)}}) + "\n")
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")
    tmp.replace(path)  # a crash mid-write never leaves a truncated file that looks complete
    return path


def read_label_file(path: str | Path) -> LabelFile:
    path = Path(path)
    if not path.is_file():
        raise LabelFileError(f"{path}: no such label file; `caspo value collect` writes one")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines or "header" not in json.loads(lines[0]):
        raise LabelFileError(f"{path}: the first line must be the header written by `caspo value collect`")
    header = json.loads(lines[0])["header"]
    if header.get("format") != FORMAT:
        raise LabelFileError(f"{path}: format {header.get('format')!r}, this code reads {FORMAT!r}")
    rows = []
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            row = LabelRow(**json.loads(line))
        except TypeError as err:
            raise LabelFileError(f"{path}:{lineno}: not a label row ({err})") from err
        if row.provenance != header["provenance"]:
            raise LabelFileError(f"{path}:{lineno}: the row's provenance differs from the file header's")
        if not 0 <= row.boundary <= len(row.response_tokens) or not 0.0 <= row.p_hat <= 1.0:
            raise LabelFileError(f"{path}:{lineno}: boundary {row.boundary} or p_hat {row.p_hat} out of range")
        rows.append(row)
    if len(rows) != header["rows"]:
        raise LabelFileError(f"{path}: header says {header['rows']} rows, found {len(rows)}")
    return LabelFile(header, rows)


def merge_label_files(paths: Sequence[str | Path], out: str | Path, allow_empty: bool = True) -> LabelFile:
    """Concatenate the shards i/n (i = 0 … n−1) of one collection, in prompt order. Without `allow_empty`,
    shards without a row are a LabelFileError and nothing is written."""
    files = [read_label_file(p) for p in paths]
    same = [{k: v for k, v in f.header.items() if k not in ("shard", "rows", "stats")} for f in files]
    for path, header in zip(paths[1:], same[1:]):
        if header != same[0]:
            differ = sorted(k for k in set(header) | set(same[0]) if header.get(k) != same[0].get(k))
            raise LabelFileError(f"{path} is from another collection than {paths[0]}: {', '.join(differ)} differ")
    shards = [tuple(map(int, f.header["shard"].split("/"))) for f in files]
    n = shards[0][1]
    if sorted(shards) != [(i, n) for i in range(n)]:
        have = ", ".join(f"{i}/{m}" for i, m in sorted(shards))
        raise LabelFileError(f"need every shard 0/{n} … {n - 1}/{n} exactly once, got {have}")
    rows = sorted((row for f in files for row in f.rows), key=lambda r: (r.prompt_index, r.sample, r.boundary))
    if not rows and not allow_empty:
        raise LabelFileError(f"the {n} shards hold no labelled prefix (no prompt had both a right and a wrong base "
                             f"rollout); {out} not written: collect more prompts or base rollouts (--prompts, --k)")
    stats = {key: sum(f.header["stats"][key] for f in files) for key in files[0].header["stats"]}
    header = {**same[0], "shard": "0/1", "merged_from": n, "stats": stats}
    header.pop("format")
    write_label_file(out, header, rows)
    return read_label_file(out)


def group_responses(rows: Sequence[LabelRow]) -> list[ResponseLabels]:
    """Rows grouped by base rollout, boundaries in increasing order."""
    groups: dict[tuple[int, int], ResponseLabels] = {}
    for i, row in enumerate(rows):
        g = groups.setdefault(row.response_key, ResponseLabels(row.prompt_id, row.prompt_tokens,
                                                               row.response_tokens, row.base_reward))
        g.boundaries.append(row.boundary)
        g.p_hats.append(row.p_hat)
        g.rows.append(i)
    for g in groups.values():
        order = sorted(range(len(g.boundaries)), key=g.boundaries.__getitem__)
        g.boundaries = [g.boundaries[i] for i in order]
        g.p_hats = [g.p_hats[i] for i in order]
        g.rows = [g.rows[i] for i in order]
    return list(groups.values())


def merge_duplicates(responses: Sequence[ResponseLabels]) -> list[ResponseLabels]:
    """One entry per distinct labelled rollout, its ``weight`` the number of copies.

    A policy that samples nearly deterministically repeats whole rollouts: with the
    embedded policy 4,200 base rollouts of one collection hold 1,062 distinct ones. Copies
    (same prompt, response, boundaries and p̂) carry the same loss terms, so one forward
    with weight w replaces w forwards exactly; order is first appearance.
    """
    merged: dict[tuple, ResponseLabels] = {}
    for r in responses:
        key = (tuple(r.prompt_tokens), tuple(r.response_tokens), tuple(r.boundaries), tuple(r.p_hats))
        first = merged.get(key)
        if first is None:
            merged[key] = ResponseLabels(r.prompt_id, r.prompt_tokens, r.response_tokens, r.base_reward,
                                         list(r.boundaries), list(r.p_hats), list(r.rows), r.weight,
                                         [list(d) for d in r.duplicate_rows])
        else:
            first.weight += r.weight
            first.duplicate_rows += [list(r.rows), *r.duplicate_rows]
    return list(merged.values())
