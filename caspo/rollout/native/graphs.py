"""CUDA graphs of the decode step and of the sampler, replayed instead of ~15 kernel launches per layer.

A decode graph is keyed by (rows, key length) and, when it samples, by the sampling parameters:
it decodes `rows` sequences, each in the cache slot its row names (a static buffer), attends over the first
`key length` positions of each, and
with sampling parameters goes on to the LM head and the sampler (`pick`), so that one replay
turns the step's input tokens into its sampled next tokens. Rows and key lengths come from
short ladders (`default_batch_sizes`, `default_key_lengths`) and a step runs in the smallest
graph that holds it, so attention reads about the positions in use rather than whole slots.
Graphs are captured on first use, with the step's real inputs already in the static buffers:
the warm-up run that precedes a capture writes the same K/V the replay writes again.

With shared-prefix attention the step's groups (`prefix_groups.PrefixGroups`) are static buffers too,
loaded each step like the tokens, positions and slots; a step the engine does not group (too little
shared to pay) replays a graph of the plain step, so the key also says whether the step is grouped.

A capture is preceded by one warm-up run of its step, unless a graph of the same key was captured before
(`warmed`, which the model runner keeps across the engine's sleeps): what the warm-up is for lives as long as
the process, so after a wake the graphs are captured again without it.

The sampler alone (`SamplerGraphs`) samples the logits of freshly prefilled prompts: the nucleus
search at top-p < 1 is about a hundred kernels, which launched one by one cost the host more than
the device runs them. Every kernel of the sampler works row by row, so the rows a graph pads with
(zero logits, or a decode step's padding rows) change nothing in the others.

Rows beyond the step's sequences carry token 0 at position 0 of a slot that no one reads again (a free
slot, or that of a sequence at its last token: `model_runner.unread_slot`): they write garbage K/V there,
which admission overwrites before anything reads it. The graphs
read the weights and the cache in place, so a publication (an in-place copy) needs no
recapture, while the engine's `sleep()` drops them along with the cache they point into.
"""

from __future__ import annotations

import bisect
import math
import time

import torch

from caspo.rollout.base import SamplingParams
from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.prefix_groups import PrefixGroups
from caspo.rollout.native.runner import Runner
from caspo.rollout.sampling import sample_next

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


def pick(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, sp: SamplingParams
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], packed [B, 3] float64: token, log-prob sampled from, untruncated log-prob)."""
    tokens, logprobs, full = sample_next(logits, seeds, positions, sp.temperature, sp.top_k, sp.top_p)
    return tokens, torch.stack([tokens.double(), logprobs.double(), full.double()], dim=-1)


def sampling_key(sp: SamplingParams) -> tuple[float, int, float]:
    """What a captured sampler depends on (stop conditions and lengths are the host's)."""
    return sp.temperature, sp.top_k, sp.top_p


def smallest_holding(ladder: list[int], n: int, what: str) -> int:
    index = bisect.bisect_left(ladder, n)
    if index == len(ladder):
        raise ValueError(f"a decode step of {n} {what} exceeds the largest graph ({ladder[-1]})")
    return ladder[index]


class DecodeGraphs:
    def __init__(self, runner: Runner, cache: KVCache, batch_sizes: list[int], key_lengths: list[int], stats=None,
                 prefix_members: int = 0, warmed: set | None = None):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the engine runs on {cache.device}")
        if max(batch_sizes) > cache.slots:
            raise ValueError(f"graph batch size {max(batch_sizes)} exceeds the cache's {cache.slots} slots")
        if max(key_lengths) != cache.max_seq_len:
            raise ValueError(f"graph key lengths must end at max_seq_len={cache.max_seq_len}, got {max(key_lengths)}")
        self.runner, self.cache, self.stats = runner, cache, stats  # stats: an EngineStats, counting captures
        self.sizes, self.key_lengths = sorted(set(batch_sizes)), sorted(set(key_lengths))
        rows = self.sizes[-1]
        self.tokens, self.positions, self.slots, self.seeds, self.steps = (
            torch.zeros(rows, dtype=torch.long, device=cache.device) for _ in range(5))
        # Shared-prefix groups (prefix_members > 0: rows a group may hold): a step of n rows has at most n // 2
        # (a group has two rows or more); only the first `count` are read.
        self.groups = None
        if prefix_members:
            long = dict(dtype=torch.long, device=cache.device)
            most = max(1, rows // 2)
            self.groups = PrefixGroups(torch.full((most, prefix_members), -1, **long),
                                       torch.zeros(most, **long), torch.zeros(most, **long),
                                       torch.zeros(rows, **long), torch.zeros(1, **long))
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None  # one memory pool for all graphs: they never run concurrently
        self.warmed = set() if warmed is None else warmed  # keys whose step has run before: no warm-up

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pad_slot: int, key_len: int,
            groups: PrefixGroups | None = None):
        """Hidden states [n, hidden] for rows 0..n-1 (row i in cache slot slots[i]), attending over keys
        [0, key_len), each of `groups` reading its prefix once; valid until the next call. The graph's padding
        rows write into `pad_slot`, a slot whose K/V no one reads again."""
        size, keys = self._load(tokens, positions, slots, pad_slot, key_len, groups)
        return self._replay((size, keys, groups is not None))[: tokens.shape[0]]

    def run_and_sample(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pad_slot: int,
                       key_len: int, seeds: torch.Tensor, steps: torch.Tensor, sp: SamplingParams,
                       groups: PrefixGroups | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`run`, then each row's next token sampled with the noise of (seeds, steps): (logits, tokens, packed)
        of rows 0..n-1 as `pick` returns them, valid until the next call."""
        n = tokens.shape[0]
        size, keys = self._load(tokens, positions, slots, pad_slot, key_len, groups)
        self.seeds[:n].copy_(seeds)
        self.steps[:n].copy_(steps)
        logits, picked, packed = self._replay((size, keys, groups is not None, *sampling_key(sp)), sp)
        return logits[:n], picked[:n], packed[:n]

    def _load(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pad_slot: int,
              key_len: int, groups: PrefixGroups | None) -> tuple[int, int]:
        n = tokens.shape[0]
        size = smallest_holding(self.sizes, n, "rows")
        keys = smallest_holding(self.key_lengths, key_len, "key positions")
        self.tokens[:n].copy_(tokens)
        self.tokens[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.slots[:n].copy_(slots)
        self.slots[n:size].fill_(pad_slot)
        if groups is not None and self.groups is None:
            raise ValueError("these graphs were built without shared-prefix groups (prefix_members=0); "
                             "build them with the engine's prefix_members to decode grouped steps")
        if groups is not None:  # padding rows are in no group: their keys from 0
            used = groups.members.shape[0]
            static = self.groups
            static.members[:used].copy_(groups.members)
            static.slots[:used].copy_(groups.slots)
            static.lengths[:used].copy_(groups.lengths)
            static.count.copy_(groups.count)
            static.starts[:n].copy_(groups.starts)
            static.starts[n:size].zero_()
        return size, keys

    def _replay(self, key: tuple, sp: SamplingParams | None = None):
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key[:3], sp, warm_up=key not in self.warmed)
            self.warmed.add(key)
        graph, output = self.graphs[key]
        graph.replay()
        return output

    def _step(self, size: int, keys: int, grouped: bool, sp: SamplingParams | None):
        groups = None
        if grouped:
            capacity = max(1, size // 2)
            groups = PrefixGroups(self.groups.members[:capacity], self.groups.slots[:capacity],
                                  self.groups.lengths[:capacity], self.groups.starts[:size], self.groups.count)
        hidden = self.runner.decode(self.tokens[:size], self.positions[:size], self.slots[:size], self.cache, keys,
                                    groups)
        if sp is None:
            return hidden
        logits = self.runner.logits(hidden)
        return (logits, *pick(logits, self.seeds[:size], self.steps[:size], sp))

    def _capture(self, size: int, keys: int, grouped: bool, sp: SamplingParams | None, warm_up: bool
                 ) -> tuple[torch.cuda.CUDAGraph, object]:
        started = time.perf_counter()
        graph, output = capture(lambda: self._step(size, keys, grouped, sp), self.cache.device, self.pool, warm_up)
        self.pool = graph.pool()
        if self.stats is not None:
            self.stats.graph_captures += 1
            self.stats.capture_s += time.perf_counter() - started
        return graph, output


class SamplerGraphs:
    """The sampler alone as graphs keyed by (rows, sampling parameters), with static logits, seeds and positions.

    It has a memory pool of its own, apart from the decode graphs', and the engine's sleep drops it too.
    """

    def __init__(self, batch_sizes: list[int], vocab_size: int, device: torch.device, warmed: set | None = None):
        self.sizes = sorted(set(batch_sizes))
        rows = self.sizes[-1]
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None
        self.warmed = set() if warmed is None else warmed

    def run(self, logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, sp: SamplingParams
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """`pick` of rows 0..n-1, as views valid until the next call."""
        n = logits.shape[0]
        size = smallest_holding(self.sizes, n, "rows")
        self.logits[:n].copy_(logits)
        self.logits[n:size].zero_()
        self.seeds[:n].copy_(seeds)
        self.positions[:n].copy_(positions)
        key = (size, *sampling_key(sp))
        if key not in self.graphs:
            step = lambda: pick(self.logits[:size], self.seeds[:size], self.positions[:size], sp)  # noqa: E731
            graph, outputs = capture(step, self.logits.device, self.pool, warm_up=key not in self.warmed)
            self.pool = graph.pool()
            self.graphs[key] = graph, outputs
            self.warmed.add(key)
        graph, (tokens, packed) = self.graphs[key]
        graph.replay()
        return tokens[:n], packed[:n]


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture(step, device: torch.device, pool, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `step()` in memory pool `pool` (None: a new one), and the outputs of its capture.

    With `warm_up`, one run on a side stream first: library handles, workspaces, Triton and inductor
    compilations are created on first use, which must not happen during capture. All of them outlive the
    graph, so a step that ran once in this process needs no second warm-up; skipping it saves about half of
    a recapture's host time (0.5 s of a 64 × 8 rollout on an H100, benchmarks/RESULTS.md).

    The warm-ups' side stream is the same for every capture: cuBLAS keeps a workspace for each stream it
    has run on, so a new stream per warm-up would hold more workspaces step after step, up to one for each
    of the 32 streams torch's pool hands out (about 1 GiB on an H100).
    """
    if warm_up:
        if device not in _WARMUP_STREAMS:
            _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
        stream = _WARMUP_STREAMS[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output
