"""The device side of the engine: prefill, the decode step, the sampling hand-off, teacher-forced logits.

`ModelRunner` (nano-vllm's name for this half) turns the scheduler's decisions into forwards of
the decoder (`runner.py` or `looped_runner.py`) over the KV cache, and owns what points into
that cache: the CUDA graphs of the decode step and each slot's last prompt hidden state. A decode step
ends with the next token of each of its sequences sampled (inside its graph, with sampler graphs on);
freshly prefilled prompts are sampled on their own (as graphs of the sampler alone). It reads the
scheduler's sequences (slots, prompts, seeds, tokens) but never changes them.

Nothing here waits for the device unless it must: host-built index tensors are copied from
pinned memory, and the sampled tokens reach the host through a non-blocking copy (`Picked`),
so the engine can launch the next decode step before it reads this step's tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from caspo.rollout.base import SamplingParams
from caspo.rollout.native.graphs import DecodeGraphs, SamplerGraphs, default_key_lengths, pick, smallest_holding
from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.prefix import SharedPrefix
from caspo.rollout.native.prefix_groups import PrefixGroups, group_rows, members_per_group, worth_grouping
from caspo.rollout.native.runner import Batch, Runner
from caspo.rollout.native.scheduler import PrefillWave, PromptPiece, SequenceState
from caspo.rollout.native.spec import DecoderSpec


class ModelRunner:
    def __init__(self, runner: Runner, cache: KVCache, spec: DecoderSpec, *, max_seq_len: int,
                 graph_batch_sizes: list[int] | None, sampler_graphs: bool = True, stats=None,
                 shared_prefix: bool = False):
        self.runner, self.cache, self.spec, self.stats = runner, cache, spec, stats
        # Rows a shared-prefix group may hold; 0: every row reads its own prompt K/V.
        self.prefix_members = members_per_group(spec.num_heads, spec.num_kv_heads) if shared_prefix else 0
        self.bytes_per_key = 2 * spec.num_kv_heads * spec.head_dim * cache.dtype.itemsize  # K and V, one layer
        self.device, self.max_seq_len = cache.device, max_seq_len
        self.graph_batch_sizes = graph_batch_sizes  # None: no CUDA graphs
        self.graph_sampler = graph_batch_sizes is not None and sampler_graphs
        # Graph keys captured before: kept across sleeps, so a wake's recaptures skip their warm-up runs.
        self.warmed_decode, self.warmed_sampler = set(), set()
        # Final-norm hidden state of each slot's last prompt position: what an exact prefix share reuses.
        self.prompt_hidden = torch.zeros(cache.slots, spec.hidden_size, dtype=cache.dtype, device=self.device)
        self.graphs = self._capture() if graph_batch_sizes is not None else None
        self.sampler_graphs = self._sampler_graphs()

    # ------------------------------------------------------------ memory
    def sleep(self, release=None) -> None:
        """Drop the graphs (they point into the cache and the weights), the cache, and `release()` what else."""
        self.graphs = self.sampler_graphs = None
        self.cache.release()
        if release is not None:
            release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.device.type == "cuda" and not self.cache.allocated:
            # The trainer's freed blocks (activations of every size) sit in the caching allocator, too
            # fragmented to hold the cache: released first, they are not reserved beside it.
            torch.cuda.empty_cache()
        self.cache.allocate()
        if self.graph_batch_sizes is not None and self.graphs is None:
            self.graphs = self._capture()
        if self.sampler_graphs is None:
            self.sampler_graphs = self._sampler_graphs()

    def _capture(self) -> DecodeGraphs:
        return DecodeGraphs(self.runner, self.cache, self.graph_batch_sizes, default_key_lengths(self.max_seq_len),
                            stats=self.stats, prefix_members=self.prefix_members, warmed=self.warmed_decode)

    def _sampler_graphs(self) -> SamplerGraphs | None:
        if not self.graph_sampler:
            return None
        return SamplerGraphs(self.graph_batch_sizes, self.spec.vocab_size, self.device, warmed=self.warmed_sampler)

    # ------------------------------------------------------------ prefill
    def prefill(self, plan: list[PrefillWave], seqs: list[SequenceState]) -> torch.Tensor:
        """Run the scheduler's prefill plan for the admitted `seqs`; returns their first logits [len(seqs), vocab]."""
        for wave in plan:
            self._copy_shared_prefixes(wave.shares)
            exact = [(seq.slot, shared.slot) for seq, shared in wave.shares if shared.exact]
            if exact:  # a wave's donors are resident or earlier waves', never its own members: one copy
                into, donors = self._tensors(*zip(*exact))
                self.prompt_hidden[into] = self.prompt_hidden[donors]
            for pieces in wave.forwards:
                self._forward_prompts(pieces)
        return self.runner.logits(self.prompt_hidden[self._tensor([s.slot for s in seqs])])

    def _copy_shared_prefixes(self, shares: list[tuple[SequenceState, SharedPrefix]]) -> None:
        """Each shared prefix into the slots of the prompts sharing it: one copy per donor slot and length (the G
        samples of a prompt, the K continuations of a Monte Carlo state), not one per sharer."""
        sharers: dict[tuple[int, int], list[int]] = {}
        for seq, shared in shares:
            sharers.setdefault((shared.slot, shared.length), []).append(seq.slot)
        if not sharers:
            return
        slots = self._tensor([slot for group in sharers.values() for slot in group])  # one host-to-device copy
        start = 0
        for (donor, length), group in sharers.items():
            self.cache.copy_prefix(donor, slots[start:start + len(group)], length)
            start += len(group)

    def _forward_prompts(self, pieces: list[PromptPiece]) -> None:
        """One prefill forward of prompt pieces, padded to the longest; keeps the hidden state of finished prompts."""
        width = max(p.count for p in pieces)
        tokens = [t for p in pieces for t in p.seq.prompt[p.start:p.start + p.count] + [0] * (width - p.count)]
        done = [(i, p.seq.slot, p.count - 1) for i, p in enumerate(pieces) if p.start + p.count == len(p.seq.prompt)]
        tokens, starts, slots, *finished = self._tensors(tokens, [p.start for p in pieces],  # one copy for all
                                                         [p.seq.slot for p in pieces], *zip(*done))
        # Padding positions run past the prompt: their K/V land in the slot's own future positions
        # (clamped into the slot), which decoding overwrites before any query reads them.
        positions = (starts[:, None] + torch.arange(width, device=self.device)).clamp(max=self.max_seq_len - 1)
        key_len = max(p.start + p.count for p in pieces)
        batch = Batch.build(slots, positions, key_len, self.spec.kv_groups, rope_kernel=self.runner.rope_kernel,
                            from_zero=all(p.start == 0 for p in pieces))
        hidden = self.runner(tokens.view(len(pieces), width), batch, self.cache)
        if finished:
            rows, done_slots, last = finished
            self.prompt_hidden[done_slots] = hidden[rows, last]

    # ------------------------------------------------------------ decode
    def decode(self, ahead: list[tuple[int, int, int]], sampled: torch.Tensor, seqs: list[SequenceState],
               sp: SamplingParams) -> Decoded:
        """One step for the scheduler's (row, slot, position) triples, input token `sampled[row]` (still on the
        device), and the next token of each of those sequences (`seqs[row]`), sampled with the noise of
        (seed, token index): the token being fed is index len(tokens), so the one sampled is the next.

        The step's row j is ahead[j]'s sequence, in its cache slot: only the sequences decoded are computed,
        whichever slots they hold.
        """
        rows = [row for row, _, _ in ahead]
        slots = [slot for _, slot, _ in ahead]
        positions = [position for _, _, position in ahead]
        decoded = [seqs[row] for row in rows]
        columns = [rows, slots, positions, [seq.request.seed for seq in decoded],
                   [len(seq.tokens) + 1 for seq in decoded]]
        grouped = self._prefix_groups(decoded, slots) if self.prefix_members else None
        rows_t, slots_t, positions_t, seeds, steps, *group_columns = self._tensors(*columns, *(grouped or ()))
        groups = None
        if grouped is not None:
            members, group_slots, lengths, starts, count = group_columns
            groups = PrefixGroups(members.view(len(group_slots), self.prefix_members), group_slots, lengths, starts,
                                  count)
        tokens, key_len = sampled.index_select(0, rows_t), max(positions) + 1
        size = len(ahead) if self.graphs is None else smallest_holding(self.graphs.sizes, len(ahead), "rows")
        if self.stats is not None:
            self.stats.decode_rows += size
        # The largest graph has as many rows as the cache has slots: a padded step leaves some slot unread.
        pad_slot = unread_slot(slots, self.cache.slots) if size > len(ahead) else 0
        if self.graphs is None:
            hidden = self.runner.decode(tokens, positions_t, slots_t, self.cache, key_len, groups)
        elif self.graph_sampler:
            logits, picked, packed = self.graphs.run_and_sample(tokens, positions_t, slots_t, pad_slot, key_len,
                                                                seeds, steps, sp, groups)
            return Decoded(slots, picked, packed, logits, sp)
        else:
            hidden = self.graphs.run(tokens, positions_t, slots_t, pad_slot, key_len, groups)
        logits = self.runner.logits(hidden)
        picked, packed = pick(logits, seeds, steps, sp)
        return Decoded(slots, picked, packed, logits, sp)

    def _prefix_groups(self, decoded: list[SequenceState], slots: list[int]) -> list[np.ndarray] | None:
        """The step's rows that hold one prompt's K/V (`prompt_group`), grouped to read it once: the host
        columns of PrefixGroups (members flattened); None where grouping would not pay (`worth_grouping`)."""
        table, starts = group_rows(np.fromiter((s.prompt_group for s in decoded), np.int64, len(decoded)),
                                   np.fromiter((len(s.prompt) for s in decoded), np.int64, len(decoded)),
                                   self.prefix_members)
        if not worth_grouping(table, starts, self.bytes_per_key):
            return None
        if self.stats is not None:
            self.stats.grouped_steps += 1
        first = table[:, 0]
        return [table.ravel(), np.asarray(slots)[first], starts[first], starts, np.array([len(table)])]

    # ------------------------------------------------------------ sampling
    def sample(self, seqs: list[SequenceState], logits: torch.Tensor, sp: SamplingParams, top_n: int) -> Picked:
        """One token per sequence from its freshly prefilled logits, sampled on the device with the noise of
        (seed, token index)."""
        seeds = self._tensor([s.request.seed for s in seqs])
        steps = self._tensor([len(s.tokens) for s in seqs])
        if self.sampler_graphs is not None:
            tokens, packed = self.sampler_graphs.run(logits, seeds, steps, sp)
        else:
            tokens, packed = pick(logits, seeds, steps, sp)
        return Picked(tokens, packed, top_logprobs(logits, sp, top_n))

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        """An int64 tensor on the device, copied without waiting for the work queued on it."""
        return self._tensors(values)[0]

    def _tensors(self, *columns: Sequence[int] | np.ndarray) -> list[torch.Tensor]:
        """Int64 device tensors of several columns, in one copy that does not wait for the work queued on the
        device. (A copy from pageable host memory may synchronize with the stream; a pinned one does not.)"""
        flat = [np.asarray(c, dtype=np.int64).reshape(-1) for c in columns]
        host = torch.from_numpy(np.concatenate(flat))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return list(host.to(self.device, non_blocking=True).split([len(c) for c in flat]))

    # ------------------------------------------------------------ scoring
    def teacher_forced_logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Float32 logits [len, vocab] at every position, through the prefill path, the slots as scratch space."""
        out = []
        for start in range(0, len(sequences), self.cache.slots):
            group = [list(s) for s in sequences[start:start + self.cache.slots]]
            width = max(map(len, group))
            tokens = torch.tensor([s + [0] * (width - len(s)) for s in group], device=self.device)
            positions = torch.arange(width, device=self.device).expand(len(group), width)
            slots = torch.arange(len(group), device=self.device)
            batch = Batch.build(slots, positions, width, self.spec.kv_groups, rope_kernel=self.runner.rope_kernel,
                                from_zero=True)
            hidden = self.runner(tokens, batch, self.cache)
            logits = self.runner.logits(hidden).float()
            out += [logits[i, :len(s)] for i, s in enumerate(group)]
        return out


def top_logprobs(logits: torch.Tensor, sp: SamplingParams, top_n: int) -> torch.Tensor | None:
    """[B, 2 top_n] float64: the ids, then the log-probs, of each row's `top_n` likeliest tokens under
    softmax(logits / T) (T = 1 when greedy); None when top_n is 0."""
    if not top_n:
        return None
    values, ids = torch.topk(torch.log_softmax(logits.float() / (sp.temperature or 1.0), -1), top_n, dim=-1)
    return torch.cat([ids.double(), values.double()], dim=-1)


def unread_slot(decoded: list[int], slots: int) -> int:
    """A cache slot whose K/V no one reads again, for a graph's padding rows to write into: a free slot, or the
    slot of a running sequence left out of the step (at its last token, it finishes without another read).
    Some slot is one whenever the step decodes fewer sequences than the cache has slots."""
    taken = set(decoded)
    for slot in range(slots):
        if slot not in taken:
            return slot
    raise ValueError(f"every one of the {slots} slots is decoded: the step has no padding rows to place")


class Decoded:
    """A decode step's sampled next tokens, row j for slot `slots[j]`; in the decode graph's memory, so
    `picked` must take what it needs before the next step."""

    def __init__(self, slots: list[int], tokens: torch.Tensor, packed: torch.Tensor, logits: torch.Tensor,
                 sp: SamplingParams):
        self.row = {slot: j for j, slot in enumerate(slots)}
        self.tokens, self.packed, self.logits, self.sp = tokens, packed, logits, sp

    def picked(self, slots: list[int], top_n: int) -> Picked:
        """The tokens of the sequences in `slots` (each decoded by this step), in that order."""
        index = torch.tensor([self.row[slot] for slot in slots], dtype=torch.int64)
        if self.tokens.is_cuda:
            index = index.pin_memory().to(self.tokens.device, non_blocking=True)
        logits = self.logits.index_select(0, index) if top_n else None
        return Picked(self.tokens.index_select(0, index), self.packed.index_select(0, index),
                      top_logprobs(logits, self.sp, top_n))


class Picked:
    """One step's sampled tokens: on the device for the next decode, copied to the host without blocking it."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, top: torch.Tensor | None):
        self.tokens, self.packed, self.top = tokens, packed, top
        # Token ids are exact in float64; one copy carries tokens and both log-probs.
        copies = [packed] if top is None else [packed, top]
        if tokens.is_cuda:
            self._host = [c.to("cpu", non_blocking=True) for c in copies]  # pinned by the allocator
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = copies, None

    def join(self, other: Picked) -> Picked:
        """These rows, then `other`'s."""
        tops = None if self.top is None else torch.cat([self.top, other.top])
        return Picked(torch.cat([self.tokens, other.tokens]), torch.cat([self.packed, other.packed]), tops)

    def read(self) -> list[tuple[int, float, float, list[tuple[int, float]] | None]]:
        """(token, log-prob sampled from, log-prob untruncated, top pairs or None) per row."""
        if self._ready is not None:
            self._ready.synchronize()
        rows = self._host[0].tolist()
        if len(self._host) == 1:
            return [(int(t), lp, full, None) for t, lp, full in rows]
        top = self._host[1].tolist()
        n = len(top[0]) // 2
        return [(int(t), lp, full, list(zip(map(int, tp[:n]), tp[n:]))) for (t, lp, full), tp in zip(rows, top)]
