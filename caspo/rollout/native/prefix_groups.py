"""Which rows of a decode step read one prompt's K/V together (the host's side of `shared_prefix_attention`).

Prefix sharing copies a prompt's K/V byte for byte into the slot of every sequence with that whole
prompt (the K continuations of one Monte Carlo prefix, the G samples of one prompt): such rows hold
equal keys [0, P), and the shared-prefix kernel reads them once for the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

QUERY_VECTORS = 64  # query vectors one prefix program scores: up to QUERY_VECTORS // G rows of a group


def members_per_group(num_heads: int, kv_heads: int) -> int:
    """The most rows one group may hold: as many as fill QUERY_VECTORS query vectors with their G heads each."""
    return max(1, QUERY_VECTORS // (num_heads // kv_heads))


@dataclass
class PrefixGroups:
    """Rows of a decode step whose slots hold the same K/V in [0, P): each group's prefix is read once.

    members [NG, M] int64: the rows of each group, -1 past its last; slots [NG]: a slot holding the group's
    prefix (any member's); lengths [NG]: P, 0 for an unused group; starts [B]: the first key a row reads
    from its own slot (its group's P, or 0).
    """

    members: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor


def group_rows(keys: Sequence[tuple[int, int] | None], members: int) -> tuple[list[list[int]], list[int]]:
    """Rows with equal keys (prompt group, prompt length), at least two, in groups of at most `members`;
    and each row's prefix length in its group, 0 for a row in none. `keys[b]` None: row b shares nothing."""
    by_key: dict[tuple[int, int], list[int]] = {}
    for row, key in enumerate(keys):
        if key is not None:
            by_key.setdefault(key, []).append(row)
    groups, starts = [], [0] * len(keys)
    for (_, length), rows in by_key.items():
        for first in range(0, len(rows), members):
            chunk = rows[first:first + members]
            if len(chunk) < 2:
                continue  # alone, a row reads its own prefix as cheaply
            groups.append(chunk)
            for row in chunk:
                starts[row] = length
    return groups, starts
