"""Which cache slot already holds the K/V of a prompt, or of a prefix of it.

Every resident sequence offers its prompt: the whole prompt, and each prefix of it that ends
on a block boundary (every `block` tokens). A new prompt takes the longest offer that it
starts with:

- the same whole prompt (the G samples of one prompt): it copies that K/V and the hidden
  state of the last prompt position, and computes nothing;
- a whole shorter prompt, or a block prefix (continuations from successive step
  boundaries of one response): it copies that K/V and computes only the rest. At least
  the last prompt token is always computed, since its hidden state gives the first logits.

Keys chain a hash over the blocks, so a lookup costs one pass over the prompt plus one
probe per distinct resident prompt length; every hit is checked token by token, so a hash
collision can never hand a request the wrong K/V.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Container, Sequence


@dataclass(frozen=True)
class SharedPrefix:
    slot: int  # the slot holding the K/V
    length: int  # positions [0, length) are shared
    exact: bool  # the whole prompt: its last hidden state is shared too


class PrefixIndex:
    def __init__(self, block: int = 16):
        self.block = block
        self.prompts: dict[int, list[int]] = {}  # slot -> its prompt
        self.whole: dict[tuple[int, int], int] = {}  # (length, hash) of a whole prompt -> slot
        self.blocks: dict[tuple[int, int], int] = {}  # (length, hash) of a block prefix -> slot
        self.whole_lengths: Counter[int] = Counter()  # lengths present in `whole`
        self.owned: dict[int, list[tuple[dict, tuple[int, int]]]] = {}  # slot -> the entries it holds

    def _block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the prefixes ending on each block boundary."""
        hashes, h = [], 0
        for start in range(0, len(tokens) // self.block * self.block, self.block):
            h = hash((h, tuple(tokens[start:start + self.block])))
            hashes.append(h)
        return hashes

    def _key(self, tokens: Sequence[int], block_hashes: list[int], length: int) -> tuple[int, int]:
        """Key of the prefix tokens[:length]: the chain up to its last block boundary, then the tail."""
        full = length // self.block
        h = block_hashes[full - 1] if full else 0
        return length, hash((h, tuple(tokens[full * self.block:length])))

    def add(self, slot: int, prompt: Sequence[int]) -> None:
        """Offer the prompt of `slot`; the first slot to offer a given prefix keeps the entry."""
        self.prompts[slot] = list(prompt)
        hashes = self._block_hashes(prompt)
        entries = [(self.whole, self._key(prompt, hashes, len(prompt)))]
        entries += [(self.blocks, (k * self.block, h)) for k, h in enumerate(hashes, start=1)]
        self.owned[slot] = [(table, key) for table, key in entries if table.setdefault(key, slot) == slot]
        self.whole_lengths.update(key[0] for table, key in self.owned[slot] if table is self.whole)

    def remove(self, slot: int) -> None:
        """Forget a slot whose sequence left the cache."""
        self.prompts.pop(slot, None)
        for table, key in self.owned.pop(slot, []):
            del table[key]
            if table is self.whole:
                self.whole_lengths[key[0]] -= 1
                if not self.whole_lengths[key[0]]:
                    del self.whole_lengths[key[0]]

    def _holder(self, table: dict, key: tuple[int, int], prompt: Sequence[int], skip: Container[int]) -> int | None:
        slot = table.get(key)
        length = key[0]
        if slot is not None and slot not in skip and self.prompts[slot][:length] == list(prompt[:length]):
            return slot
        return None

    def lookup(self, prompt: Sequence[int], skip: Container[int] = ()) -> SharedPrefix | None:
        """The longest prefix of `prompt` offered by a slot not in `skip`, or None."""
        hashes = self._block_hashes(prompt)
        slot = self._holder(self.whole, self._key(prompt, hashes, len(prompt)), prompt, skip)
        if slot is not None:
            return SharedPrefix(slot, len(prompt), exact=True)
        best = None
        for length in sorted((n for n in self.whole_lengths if n < len(prompt)), reverse=True):
            slot = self._holder(self.whole, self._key(prompt, hashes, length), prompt, skip)
            if slot is not None:
                best = SharedPrefix(slot, length, exact=False)
                break
        for k in range((len(prompt) - 1) // self.block, 0, -1):
            length = k * self.block
            if best is not None and length <= best.length:
                break
            slot = self._holder(self.blocks, (length, hashes[k - 1]), prompt, skip)
            if slot is not None:
                return SharedPrefix(slot, length, exact=False)
        return best
