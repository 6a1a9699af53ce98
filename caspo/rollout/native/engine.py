"""`NativeEngine`: continuous batching over the native runner, behind the engine protocol of `HFEngine`.

One `generate` call repeats, until every request has finished:

    admit    waiting requests take free slots, strictly in request order;
    prefill  their prompts, computing only what no resident slot already holds (prefix sharing);
    sample   one token for every sequence with fresh logits (just prefilled or just decoded),
             with the counter-based noise of (sample seed, token index);
    decode   one step, launched on the device with the sampled tokens still there, for every
             sequence not at its last token;
    retire   meanwhile the host reads the tokens: finished sequences leave and free their slots
             (one that stopped on a token leaves a wasted row in the step already launched).

The schedule is a function of the requests and the engine's settings alone, never of timing,
and the noise of a token does not depend on the batch: a completion is a function of
(weights, prompt, seed, sampling parameters), up to floating-point summation order.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import AutoConfig

from caspo.rollout.base import Completion, Request, SamplingParams
from caspo.rollout.native.graphs import DecodeGraphs, default_batch_sizes, default_key_lengths
from caspo.rollout.native.kv_cache import CapacityReport, KVCache
from caspo.rollout.native.looped_runner import LoopedCausalLM
from caspo.rollout.native.prefix import PrefixIndex, SharedPrefix
from caspo.rollout.native.runner import (Batch, CausalLM, build_runner, decode_attention, read_checkpoint,
                                         weights_dtype)
from caspo.rollout.native.spec import LoopedSpec, decoder_spec
from caspo.rollout.publication import Publication, PublishedWeights
from caspo.rollout.sampling import sample_next

STOP_STRING_WINDOW = 32  # tokens decoded to look for a stop string, as HFEngine does


@dataclass
class NativeCompletion(Completion):
    """A completion with the log-probs of its tokens under the untruncated distribution as well.

    logprobs (from Completion): under the distribution sampled from (temperature, top-k, top-p).
    logprobs_full: under softmax(logits / temperature) over the whole vocabulary (temperature 1 when greedy).
    top_logprobs: per position, (token, log-prob) of the most likely tokens of that untruncated
        distribution, most likely first; None unless `generate(..., top_logprobs=K)` asked for them.
    """

    logprobs_full: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class EngineStats:
    """Running totals since the engine was built; compare two readings to measure one call."""

    prefill_tokens: int = 0  # prompt positions computed
    shared_tokens: int = 0  # prompt positions copied from a resident slot instead of computed
    decode_steps: int = 0
    generated_tokens: int = 0


@dataclass
class _Sequence:
    index: int  # position in the request list
    request: Request
    slot: int
    length: int = 0  # positions of the slot holding this sequence's K/V
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_full: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt: list[int] = field(init=False)

    def __post_init__(self):
        self.prompt = list(self.request.prompt_ids)


class NativeEngine(PublishedWeights):
    """Rollout engine over a native Qwen2/Llama runner, or the looped runner for a `caspo_looped` model.

    model: a live `transformers` Qwen2/Llama causal LM or `LoopedForCausalLM` (weights read from
        `named_parameters()`), or a `save_pretrained` folder (config.json + safetensors).
    max_seq_len: positions per sequence (prompt + max_new_tokens); the size of a cache slot.
    capacity_tokens / gpu_memory_fraction: the most the KV cache may take (exactly one; the fraction on CUDA only).
    max_running: sequences decoded at once; the cache then holds exactly that many slots (default: as many as fit).
    max_prefill_tokens: padded prompt positions per prefill forward; longer prompts are prefilled in pieces.
    prefix_sharing: prompts sharing a prefix with a resident sequence copy its K/V instead of computing it.
    cuda_graphs: replay CUDA graphs of the decode step, captured per (rows, key length) on first use (CUDA only).
    decode_kernel: decode attention through the split-K Triton kernel instead of masked SDPA
        (default: on CUDA; it reads each sequence's K/V once, where SDPA reads them at ~1/3 of the bandwidth).
    dtype / device: compute dtype and device (default: those of the weights).
    decode: token ids -> text, needed only for stop strings.
    """

    def __init__(self, model: nn.Module | str | os.PathLike, *, max_seq_len: int, capacity_tokens: int | None = None,
                 gpu_memory_fraction: float | None = None, max_running: int | None = None,
                 max_prefill_tokens: int = 8192, prefix_sharing: bool = True, cuda_graphs: bool = False,
                 graph_batch_sizes: list[int] | None = None, decode_kernel: bool | None = None,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, decode: Callable[[list[int]], str] | None = None):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        config, tensors, source_device = _read_source(model)
        self.spec = decoder_spec(config)
        self.device = torch.device(device) if device is not None else source_device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this engine runs on {self.device}")
        self.dtype = dtype or weights_dtype(tensors)
        self.max_seq_len = max_seq_len
        runner_class = LoopedCausalLM if isinstance(self.spec, LoopedSpec) else CausalLM
        self.runner = build_runner(runner_class, self.spec, tensors, dtype=self.dtype, device=self.device, max_seq_len=max_seq_len)
        del tensors
        self.runner.decode_kernel = self.device.type == "cuda" if decode_kernel is None else decode_kernel
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # triton's CPU interpreter (tests)
        if self.runner.decode_kernel and (decode_attention is None
                                          or not (self.device.type == "cuda" or interpreted)):
            raise ValueError(f"decode_kernel=True needs triton and a CUDA device (device {self.device}, triton "
                             f"{'missing' if decode_attention is None else 'present'}); "
                             f"pass decode_kernel=False for masked SDPA")
        # A looped model keeps one plane per loop: a token's K/V take `planes` times the bytes.
        per_token = KVCache.bytes_per_token(layers=self.spec.num_layers, kv_heads=self.spec.num_kv_heads,
                                            head_dim=self.spec.head_dim, dtype=self.dtype, planes=self.spec.planes)
        fit = KVCache.slots_for(max_seq_len=max_seq_len, bytes_per_token=per_token, device=self.device,
                                capacity_tokens=capacity_tokens, gpu_memory_fraction=gpu_memory_fraction,
                                planes=self.spec.planes)
        if max_running is not None and not 1 <= max_running <= fit:
            raise ValueError(f"max_running={max_running}, but the KV cache holds {fit} sequences "
                             f"of max_seq_len={max_seq_len}; raise its capacity or lower max_running")
        # A slot beyond max_running could never be used: the cache holds exactly max_running slots.
        self.cache = KVCache(slots=max_running or fit, max_seq_len=max_seq_len, layers=self.spec.num_layers,
                             kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim, dtype=self.dtype,
                             device=self.device, planes=self.spec.planes)
        self.max_running = self.cache.slots
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_sharing = prefix_sharing
        self.graph_batch_sizes = None
        if cuda_graphs:
            self.graph_batch_sizes = sorted(set(graph_batch_sizes or default_batch_sizes(self.max_running)))
            if self.graph_batch_sizes[-1] < self.max_running:
                raise ValueError(f"graph_batch_sizes end at {self.graph_batch_sizes[-1]}, below "
                                 f"max_running={self.max_running}: larger decode batches would have no graph")
        self.decode = decode
        self.version = 0
        self.stats = EngineStats()
        # Final-norm hidden state of each slot's last prompt position: what an exact prefix share reuses.
        self._prompt_hidden = torch.zeros(self.cache.slots, self.spec.hidden_size, dtype=self.dtype,
                                          device=self.device)
        self._prefixes: PrefixIndex | None = None
        self._publication: Publication | None = None
        self._graphs = self._capture() if cuda_graphs else None

    # ------------------------------------------------------------ publication
    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.runner.named_parameters())

    # ------------------------------------------------------------ memory
    def capacity_report(self) -> CapacityReport:
        return self.cache.capacity_report()

    @property
    def asleep(self) -> bool:
        return not self.cache.allocated

    def sleep(self) -> None:
        """Free the KV cache (and the graphs that point into it); the weights stay."""
        self._graphs = None
        self.cache.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.cache.allocate()
        if self.graph_batch_sizes is not None and self._graphs is None:
            self._graphs = self._capture()

    def _capture(self) -> DecodeGraphs:
        return DecodeGraphs(self.runner, self.cache, self.graph_batch_sizes, default_key_lengths(self.max_seq_len))

    # ------------------------------------------------------------ generation
    def generate(self, requests: Sequence[Request], sampling: SamplingParams, *,
                 top_logprobs: int = 0) -> list[NativeCompletion]:
        self._check(requests, sampling, top_logprobs)
        with torch.no_grad():
            return self._generate(list(requests), sampling, top_logprobs)

    def _check(self, requests: Sequence[Request], sampling: SamplingParams, top_logprobs: int) -> None:
        if self.asleep:
            raise RuntimeError("the engine is asleep (KV cache released); call wake() before generate()")
        if sampling.stop_strings and self.decode is None:
            raise ValueError("stop strings need a decode function: NativeEngine(..., decode=tokenizer.decode)")
        if not 0 <= top_logprobs <= self.spec.vocab_size:
            raise ValueError(f"top_logprobs must be in [0, {self.spec.vocab_size}], got {top_logprobs}")
        for i, r in enumerate(requests):
            if not r.prompt_ids or r.max_new_tokens < 1:
                raise ValueError(f"request {i}: needs a non-empty prompt and max_new_tokens >= 1")
            if len(r.prompt_ids) + r.max_new_tokens > self.max_seq_len:
                raise ValueError(f"request {i}: prompt {len(r.prompt_ids)} + max_new_tokens {r.max_new_tokens} "
                                 f"exceeds max_seq_len={self.max_seq_len}")

    def _generate(self, requests: list[Request], sp: SamplingParams, top_logprobs: int) -> list[NativeCompletion]:
        results: list[NativeCompletion | None] = [None] * len(requests)
        waiting = deque(enumerate(requests))
        free = list(range(self.max_running))  # a heap: the lowest slots first keeps decode rows packed
        # Fresh per call: K/V left by an earlier call may predate a publication.
        self._prefixes = PrefixIndex() if self.prefix_sharing else None
        stop_ids = set(sp.stop_token_ids)
        active: list[_Sequence] = []  # sequences whose next-token logits are `logits`, row for row
        logits: torch.Tensor | None = None
        while waiting or active:
            admitted = []
            while waiting and free:
                index, request = waiting.popleft()
                admitted.append(_Sequence(index, request, heapq.heappop(free)))
            if admitted:
                fresh = self._prefill(admitted)
                logits = fresh if logits is None else torch.cat([logits, fresh])
                active += admitted
            picked = self._sample(active, logits, sp, top_logprobs)
            # Decode ahead: the next step runs on the device while the host reads this step's tokens.
            # Sequences at their last token are left out; one that stops on a token wastes a row.
            ahead = [row for row, s in enumerate(active) if len(s.tokens) + 1 < s.request.max_new_tokens]
            hidden = self._decode([active[row] for row in ahead], picked.tokens, ahead) if ahead else None
            running = []
            for seq, (token, logprob, full, top) in zip(active, picked.read()):
                seq.tokens.append(token)
                seq.logprobs.append(logprob)
                seq.logprobs_full.append(full)
                seq.top.append(top)
                reason = self._finish_reason(seq, stop_ids, sp.stop_strings)
                if reason:
                    results[seq.index] = NativeCompletion(seq.tokens, seq.logprobs, reason, self.version,
                                                          seq.logprobs_full, seq.top if top_logprobs else None)
                    heapq.heappush(free, seq.slot)
                    if self._prefixes is not None:
                        self._prefixes.remove(seq.slot)
                else:
                    running.append(seq)
            self.stats.generated_tokens += len(active)
            active = running
            logits = self.runner.logits(self._rows(hidden, [s.slot for s in active])) if active else None
        return results

    def _finish_reason(self, seq: _Sequence, stop_ids: set[int], stop_strings: list[str]) -> str:
        if seq.tokens[-1] in stop_ids:
            return "stop"
        if stop_strings:
            tail = self.decode(seq.tokens[-STOP_STRING_WINDOW:])
            if any(tail.endswith(s) for s in stop_strings):
                return "stop"
        return "length" if len(seq.tokens) >= seq.request.max_new_tokens else ""

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor, sp: SamplingParams, top_n: int) -> "_Picked":
        """Sample one token per sequence on the device; the host reads them with `_Picked.read()`."""
        seeds = self._tensor([s.request.seed for s in seqs])
        steps = self._tensor([len(s.tokens) for s in seqs])
        tokens, logprobs, full = sample_next(logits, seeds, steps, sp.temperature, sp.top_k, sp.top_p)
        top = None
        if top_n:
            values, ids = torch.topk(torch.log_softmax(logits.float() / (sp.temperature or 1.0), -1), top_n, dim=-1)
            top = torch.cat([ids.double(), values.double()], dim=-1)
        return _Picked(tokens, torch.stack([tokens.double(), logprobs.double(), full.double()], dim=-1), top)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor on the device, copied without waiting for the work queued on it.

        (A copy from pageable host memory may synchronize with the stream; a pinned one does not.)
        """
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _rows(self, hidden: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Rows `slots` of a decode step's hidden states (row i is slot i)."""
        if slots == list(range(len(slots))):
            return hidden[: len(slots)]
        return hidden.index_select(0, self._tensor(slots))

    # ------------------------------------------------------------ prefill
    def _prefill(self, seqs: list[_Sequence]) -> torch.Tensor:
        """K/V of the admitted prompts into their slots; returns their first logits [len(seqs), vocab].

        A prompt that shares a prefix with a resident or earlier-admitted prompt copies it. Copies
        from a prompt admitted in the same round wait for that prompt's own prefill: prompts are
        processed in waves, wave w + 1 copying from wave w.
        """
        waves: list[list[tuple[_Sequence, SharedPrefix | None]]] = []
        wave_of: dict[int, int] = {}  # slot -> wave, for the slots admitted now
        for seq in seqs:
            shared = self._prefixes.lookup(seq.prompt) if self._prefixes is not None else None
            wave = wave_of[shared.slot] + 1 if shared is not None and shared.slot in wave_of else 0
            wave_of[seq.slot] = wave
            if self._prefixes is not None:
                self._prefixes.add(seq.slot, seq.prompt)
            while len(waves) <= wave:
                waves.append([])
            waves[wave].append((seq, shared))
        for members in waves:
            compute = []
            for seq, shared in members:
                if shared is not None:
                    self.cache.copy_prefix(shared.slot, seq.slot, shared.length)
                    seq.length = shared.length
                    self.stats.shared_tokens += shared.length
                    if shared.exact:
                        self._prompt_hidden[seq.slot] = self._prompt_hidden[shared.slot]
                        continue
                compute.append(seq)
            self._compute_prompts(compute)
        rows = torch.tensor([s.slot for s in seqs], device=self.device)
        return self.runner.logits(self._prompt_hidden[rows])

    def _compute_prompts(self, seqs: list[_Sequence]) -> None:
        """Prefill each prompt from its `length` on, in forwards of at most max_prefill_tokens padded positions."""
        budget = self.max_prefill_tokens
        while seqs:
            chunk, width = [], 0
            for seq in seqs:
                n = min(len(seq.prompt) - seq.length, budget)
                if chunk and (len(chunk) + 1) * max(width, n) > budget:
                    break
                chunk.append((seq, n))
                width = max(width, n)
            self._forward_prompts(chunk, width)
            seqs = [s for s in seqs if s.length < len(s.prompt)]

    def _forward_prompts(self, chunk: list[tuple[_Sequence, int]], width: int) -> None:
        tokens = [seq.prompt[seq.length:seq.length + n] + [0] * (width - n) for seq, n in chunk]
        starts = torch.tensor([seq.length for seq, _ in chunk], device=self.device)
        # Padding positions run past the prompt: their K/V land in the slot's own future positions
        # (clamped into the slot), which decoding overwrites before any query reads them.
        positions = (starts[:, None] + torch.arange(width, device=self.device)).clamp(max=self.max_seq_len - 1)
        key_len = max(seq.length + n for seq, n in chunk)
        slots = torch.tensor([seq.slot for seq, _ in chunk], device=self.device)
        batch = Batch.build(slots, positions, key_len, self.spec.kv_groups)
        hidden = self.runner(torch.tensor(tokens, device=self.device), batch, self.cache)
        done = [(i, seq.slot, n - 1) for i, (seq, n) in enumerate(chunk) if seq.length + n == len(seq.prompt)]
        if done:
            rows, done_slots, last = (torch.tensor(column, device=self.device) for column in zip(*done))
            self._prompt_hidden[done_slots] = hidden[rows, last]
        for seq, n in chunk:
            seq.length += n
            self.stats.prefill_tokens += n

    # ------------------------------------------------------------ decode
    def _decode(self, seqs: list[_Sequence], sampled: torch.Tensor, sampled_rows: list[int]) -> torch.Tensor:
        """One step for `seqs`, whose input tokens are `sampled[sampled_rows]` (still on the device).

        Returns the hidden states [rows, hidden], row i for slot i, valid until the next decode.
        """
        rows = max(s.slot for s in seqs) + 1  # row i is slot i; free slots in between ride along
        positions = [0] * rows
        for s in seqs:
            positions[s.slot] = s.length
        tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        tokens.index_copy_(0, self._tensor([s.slot for s in seqs]), sampled.index_select(0, self._tensor(sampled_rows)))
        positions_t = self._tensor(positions)
        if self._graphs is not None:
            hidden = self._graphs.run(tokens, positions_t, key_len=max(positions) + 1)
        else:
            hidden = self.runner.decode(tokens, positions_t, self.cache, key_len=max(positions) + 1)
        for s in seqs:
            s.length += 1
        self.stats.decode_steps += 1
        return hidden

    # ------------------------------------------------------------ scoring
    def teacher_forced_logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Float32 logits [len, vocab] at every position of each token sequence, through the prefill path.

        Uses the cache's slots as scratch space, up to max_running sequences per forward.
        """
        if self.asleep:
            raise RuntimeError("the engine is asleep (KV cache released); call wake() first")
        if any(not 0 < len(s) <= self.max_seq_len for s in sequences):
            raise ValueError(f"every sequence needs 1..max_seq_len={self.max_seq_len} tokens")
        out = []
        with torch.no_grad():
            for start in range(0, len(sequences), self.max_running):
                group = [list(s) for s in sequences[start:start + self.max_running]]
                width = max(map(len, group))
                tokens = torch.tensor([s + [0] * (width - len(s)) for s in group], device=self.device)
                positions = torch.arange(width, device=self.device).expand(len(group), width)
                slots = torch.arange(len(group), device=self.device)
                hidden = self.runner(tokens, Batch.build(slots, positions, width, self.spec.kv_groups), self.cache)
                logits = self.runner.logits(hidden).float()
                out += [logits[i, :len(s)] for i, s in enumerate(group)]
        return out


class _Picked:
    """One step's sampled tokens: on the device for the next decode, copied to the host without blocking it."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, top: torch.Tensor | None):
        self.tokens = tokens
        # Token ids are exact in float64; one copy carries tokens and both log-probs.
        copies = [packed] if top is None else [packed, top]
        if tokens.is_cuda:
            self._host = [c.to("cpu", non_blocking=True) for c in copies]  # pinned by the allocator
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = copies, None

    def read(self):
        """(token, log-prob sampled from, log-prob untruncated, top pairs or None) per row."""
        if self._ready is not None:
            self._ready.synchronize()
        rows = self._host[0].tolist()
        if len(self._host) == 1:
            return [(int(t), lp, full, None) for t, lp, full in rows]
        top = self._host[1].tolist()
        n = len(top[0]) // 2
        return [(int(t), lp, full, list(zip(map(int, tp[:n]), tp[n:]))) for (t, lp, full), tp in zip(rows, top)]


def _read_source(model) -> tuple[object, dict[str, torch.Tensor], torch.device]:
    """(config, named weights, their device) of a live module or a checkpoint folder."""
    if isinstance(model, nn.Module):
        if getattr(model, "config", None) is None:
            raise TypeError("NativeEngine needs a transformers model (with .config) or a save_pretrained folder")
        return model.config, dict(model.named_parameters()), next(model.parameters()).device
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; pass a save_pretrained folder or a live model")
    config = AutoConfig.from_pretrained(folder)
    decoder_spec(config)  # fail on an unsupported config before reading any weights
    return config, read_checkpoint(folder), torch.device("cpu")
