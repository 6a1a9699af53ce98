"""CUDA graphs of the decode step: one graph per batch size, replayed instead of ~15 launches per layer.

A graph is captured for the first `size` slots with static input buffers (token and position
of each row) and attends over all `max_seq_len` positions, so one graph serves every step.
Rows beyond the running sequences carry token 0 at position 0: they write garbage K/V into
position 0 of free slots, which admission overwrites before anything reads it. The graphs
read the weights and the cache in place, so a publication (an in-place copy) needs no
recapture, while the engine's `sleep()` drops them along with the cache they point into.
"""

from __future__ import annotations

import bisect

import torch

from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.runner import CausalLM


def default_batch_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, multiples of 16 up to 256, multiples of 64 beyond, and `max_rows` itself.

    A decode batch runs in the smallest graph that holds it, so the spacing bounds the rows
    computed for nothing: at most 15 up to 256 rows, at most 63 beyond.
    """
    sizes = {s for s in (1, 2, 4, 8) if s <= max_rows} | {max_rows}
    sizes |= set(range(16, min(max_rows, 256) + 1, 16)) | set(range(320, max_rows + 1, 64))
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, runner: CausalLM, cache: KVCache, batch_sizes: list[int]):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {cache.device}")
        if max(batch_sizes) > cache.slots:
            raise ValueError(f"graph batch size {max(batch_sizes)} exceeds the cache's {cache.slots} slots")
        self.runner, self.cache = runner, cache
        self.sizes = sorted(set(batch_sizes))
        largest = self.sizes[-1]
        self.tokens = torch.zeros(largest, dtype=torch.long, device=cache.device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.no_grad():
            for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
                self._warm_up(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._step(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(cache.device)

    def _step(self, size: int) -> torch.Tensor:
        return self.runner.decode(self.tokens[:size], self.positions[:size], self.cache, self.cache.max_seq_len)

    def _warm_up(self, size: int) -> None:
        # Library handles and workspaces are created on first use, which must not happen during capture.
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            self._step(size)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] for rows 0..n-1; valid until the next call."""
        n = tokens.shape[0]
        index = bisect.bisect_left(self.sizes, n)
        if index == len(self.sizes):
            raise ValueError(f"decode batch of {n} rows exceeds the largest captured graph ({self.sizes[-1]})")
        size = self.sizes[index]
        self.tokens[:n].copy_(tokens)
        self.tokens[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
