"""Which rows of a decode step read one prompt's K/V together (the host's side of `shared_prefix_attention`).

Prefix sharing copies a prompt's K/V byte for byte into the slot of every sequence with that whole
prompt (the K continuations of one Monte Carlo prefix, the G samples of one prompt): such rows hold
equal keys [0, P), and the shared-prefix kernel reads them once for the group.

Reading a prefix once costs two kernels more a layer (the prefix pass and the combine), so a step is
grouped only where the reads it saves outweigh them (`worth_grouping`): the long prefixes of Monte Carlo
continuations, not the short prompts of a rollout's G samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUERY_VECTORS = 64  # query vectors one prefix program scores: up to QUERY_VECTORS // G rows of a group
# K/V bytes a layer's grouped step must read less than the split kernel alone for its two extra kernels to
# pay: on an H200 at the Qwen2.5-1.5B shape they cost ~11-17 µs a layer, what 64 MiB take at 4.8 TB/s. Over 80
# step shapes it picked the faster path in 76, and lost at most 1.9 µs in the others (benchmarks/RESULTS.md).
MIN_BYTES_SAVED = 64 << 20


def members_per_group(num_heads: int, kv_heads: int) -> int:
    """The most rows one group may hold: as many as fill QUERY_VECTORS query vectors with their G heads each."""
    return max(1, QUERY_VECTORS // (num_heads // kv_heads))


@dataclass
class PrefixGroups:
    """Rows of a decode step whose slots hold the same K/V in [0, P): each group's prefix is read once.

    members [NG, M] int64: the rows of each group, -1 past its last; slots [NG]: a slot holding the group's
    prefix (any member's); lengths [NG]: P; starts [B]: the first key a row reads from its own slot (its
    group's P, or 0); count [1]: the groups in use, the first `count` of the NG (the rest are never read,
    so a CUDA graph's static buffers need not be cleared past them).
    """

    members: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    count: torch.Tensor


def keys_saved(table: np.ndarray, starts: np.ndarray) -> int:
    """Keys a layer reads less when `group_rows`' groups read their prefix once: (rows - 1) × P a group."""
    return int(starts.sum() - starts[table[:, 0]].sum()) if len(table) else 0


def worth_grouping(table: np.ndarray, starts: np.ndarray, bytes_per_key: int) -> bool:
    """Whether a step of these groups is faster reading each prefix once than every row reading its own (never
    for a step without a group: the grouped kernels would have nothing to read once)."""
    return len(table) > 0 and keys_saved(table, starts) * bytes_per_key >= MIN_BYTES_SAVED


def group_rows(groups: np.ndarray, lengths: np.ndarray, members: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows with equal (prompt group, prompt length), at least two, in groups of at most `members`.

    groups, lengths [B] int: each row's prompt group (-1: it shares nothing) and prompt length. Returns the
    groups as a table [NG, members] of rows (-1 past a group's last), each group's rows in increasing order,
    and each row's prefix length in its group [B], 0 for a row in none.
    """
    groups, lengths = np.asarray(groups, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    rows = np.flatnonzero(groups >= 0)
    rows = rows[np.lexsort((rows, lengths[rows], groups[rows]))]  # runs of equal keys, each run by row
    key_group, key_length = groups[rows], lengths[rows]
    run_starts = np.r_[True, (key_group[1:] != key_group[:-1]) | (key_length[1:] != key_length[:-1])]
    first_of_run = np.flatnonzero(run_starts)
    place = np.arange(len(rows)) - first_of_run[np.cumsum(run_starts) - 1]  # each row's place in its run
    chunk = np.cumsum(run_starts | (place % members == 0)) - 1  # runs cut into chunks of `members`
    kept = np.bincount(chunk)[chunk] >= 2  # a row alone in its chunk reads its own prefix as cheaply
    groups_kept, numbering = np.unique(chunk[kept], return_inverse=True)
    table = np.full((len(groups_kept), members), -1, dtype=np.int64)
    table[numbering, place[kept] % members] = rows[kept]
    starts = np.zeros(len(groups), dtype=np.int64)
    starts[rows[kept]] = key_length[kept]
    return table, starts
