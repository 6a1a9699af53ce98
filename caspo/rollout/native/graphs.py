"""CUDA graphs of the decode step, replayed instead of ~15 kernel launches per layer.

A graph is keyed by (rows, key length): it decodes the first `rows` slots and attends over
the first `key length` positions of each. Both come from short ladders (`default_batch_sizes`,
`default_key_lengths`) and a step runs in the smallest graph that holds it, so attention
reads about the positions in use rather than whole slots. Graphs are captured on first use,
with the step's real inputs already in the static buffers: the warm-up run that precedes a
capture writes the same K/V the replay writes again.

Rows beyond the running sequences carry token 0 at position 0: they write garbage K/V into
position 0 of free slots, which admission overwrites before anything reads it. The graphs
read the weights and the cache in place, so a publication (an in-place copy) needs no
recapture, while the engine's `sleep()` drops them along with the cache they point into.
"""

from __future__ import annotations

import bisect
import math
import time

import torch

from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.runner import Runner

KEY_LENGTH_QUANTUM = 64


def default_batch_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, multiples of 16 up to 256, multiples of 64 beyond, and `max_rows` itself.

    The spacing bounds the rows computed for nothing: at most 15 up to 256 rows, at most 63 beyond.
    """
    sizes = {s for s in (1, 2, 4, 8) if s <= max_rows} | {max_rows}
    sizes |= set(range(16, min(max_rows, 256) + 1, 16)) | set(range(320, max_rows + 1, 64))
    return sorted(sizes)


def default_key_lengths(max_seq_len: int, count: int = 8) -> list[int]:
    """About `count` key lengths, evenly spaced in multiples of 64, ending at `max_seq_len`."""
    step = KEY_LENGTH_QUANTUM * math.ceil(max_seq_len / count / KEY_LENGTH_QUANTUM)
    return sorted(set(range(step, max_seq_len, step)) | {max_seq_len})


def smallest_holding(ladder: list[int], n: int, what: str) -> int:
    index = bisect.bisect_left(ladder, n)
    if index == len(ladder):
        raise ValueError(f"a decode step of {n} {what} exceeds the largest graph ({ladder[-1]})")
    return ladder[index]


class DecodeGraphs:
    def __init__(self, runner: Runner, cache: KVCache, batch_sizes: list[int], key_lengths: list[int], stats=None):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {cache.device}")
        if max(batch_sizes) > cache.slots:
            raise ValueError(f"graph batch size {max(batch_sizes)} exceeds the cache's {cache.slots} slots")
        if max(key_lengths) != cache.max_seq_len:
            raise ValueError(f"graph key lengths must end at max_seq_len={cache.max_seq_len}, got {max(key_lengths)}")
        self.runner, self.cache, self.stats = runner, cache, stats  # stats: an EngineStats, counting captures
        self.sizes, self.key_lengths = sorted(set(batch_sizes)), sorted(set(key_lengths))
        self.tokens = torch.zeros(self.sizes[-1], dtype=torch.long, device=cache.device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.long, device=cache.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool for all graphs: they never run concurrently

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Hidden states [n, hidden] for rows 0..n-1, attending over keys [0, key_len); valid until the next call."""
        n = tokens.shape[0]
        size = smallest_holding(self.sizes, n, "rows")
        keys = smallest_holding(self.key_lengths, key_len, "key positions")
        self.tokens[:n].copy_(tokens)
        self.tokens[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        if (size, keys) not in self.graphs:
            self.graphs[size, keys] = self._capture(size, keys)
        graph, output = self.graphs[size, keys]
        graph.replay()
        return output[:n]

    def _step(self, size: int, keys: int) -> torch.Tensor:
        return self.runner.decode(self.tokens[:size], self.positions[:size], self.cache, keys)

    def _capture(self, size: int, keys: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        started = time.perf_counter()
        graph, output = capture(lambda: self._step(size, keys), self.cache.device, self.pool)
        self.pool = graph.pool()
        if self.stats is not None:
            self.stats.graph_captures += 1
            self.stats.capture_s += time.perf_counter() - started
        return graph, output


def capture(step, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `step()` in memory pool `pool` (None: a new one), and the outputs of its capture.

    One warm-up run on a side stream first: library handles, workspaces and Triton compilations are
    created on first use, which must not happen during capture.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output
