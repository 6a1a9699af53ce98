"""CUDA graphs of the sampler: the nucleus search and the Gumbel pick replayed as one launch.

`sampling.sample_next` is a fixed sequence of kernels for given (temperature, top-k, top-p): the
nucleus search has static shapes and never waits for the host. Launched one by one it costs
about a hundred launches per decode step at top-p < 1, which the host cannot issue as fast as
the device runs them. A graph is keyed by (rows, temperature, top-k, top-p), `rows` from the
decode graphs' ladder; its inputs are static buffers (logits, sample seeds, token indices).

Every kernel works row by row, so the rows padded past the step's (zero logits) change nothing
in the others: the graph's tokens are those of the same rows sampled eagerly. The graphs own a
memory pool of their own, apart from the decode graphs' (a step's hidden states live there while
its logits are sampled), and are dropped by the engine's sleep like the decode graphs.
"""

from __future__ import annotations

import torch

from caspo.rollout.base import SamplingParams
from caspo.rollout.native.graphs import capture, smallest_holding
from caspo.rollout.sampling import sample_next


def pick(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, sp: SamplingParams
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], packed [B, 3] float64: token, log-prob sampled from, untruncated log-prob)."""
    tokens, logprobs, full = sample_next(logits, seeds, positions, sp.temperature, sp.top_k, sp.top_p)
    return tokens, torch.stack([tokens.double(), logprobs.double(), full.double()], dim=-1)


class SamplerGraphs:
    def __init__(self, batch_sizes: list[int], vocab_size: int, device: torch.device):
        self.sizes = sorted(set(batch_sizes))
        rows = self.sizes[-1]
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None

    def run(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, sp: SamplingParams
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """`pick` of rows 0..n-1, as views valid until the next call."""
        n = logits.shape[0]
        size = smallest_holding(self.sizes, n, "rows")
        self.logits[:n].copy_(logits)
        self.logits[n:size].zero_()
        self.seeds[:n].copy_(seeds)
        self.positions[:n].copy_(positions)
        key = (size, sp.temperature, sp.top_k, sp.top_p)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, sp)
        graph, (tokens, packed) = self.graphs[key]
        graph.replay()
        return tokens[:n], packed[:n]

    def _step(self, size: int, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        return pick(self.logits[:size], self.seeds[:size], self.positions[:size], sp)

    def _capture(self, size: int, sp: SamplingParams):
        graph, outputs = capture(lambda: self._step(size, sp), self.logits.device, self.pool)
        self.pool = graph.pool()
        return graph, outputs
