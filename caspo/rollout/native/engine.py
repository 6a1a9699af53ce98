"""`NativeEngine`: continuous batching over the native runner, behind the engine protocol of `HFEngine`.

One `generate` call repeats, until every request has finished:

    admit    waiting requests take free slots, strictly in request order;
    prefill  their prompts, computing only what no resident slot already holds (prefix sharing);
    sample   one token for each just-prefilled sequence, with the counter-based noise of
             (sample seed, token index);
    decode   one step, launched on the device with the sampled tokens still there, for every
             sequence not at its last token, ending with each one's next token sampled the same way
             (in the decode step's CUDA graph, when graphs are on);
    retire   meanwhile the host reads the tokens: finished sequences leave and free their slots
             (one that stopped on a token leaves a wasted row in the step already launched).

The bookkeeping (admit, the prefill plan, retire) is `scheduler.py`; the device work (prefill,
decode, sampling) is `model_runner.py`; this file builds both and runs the loop.

The schedule is a function of the requests and the engine's settings alone, never of timing,
and the noise of a token does not depend on the batch: a completion is a function of
(weights, prompt, seed, sampling parameters), up to floating-point summation order.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import AutoConfig

from caspo.rollout.base import Completion, OnFinish, Request, SamplingParams, asleep_error
from caspo.rollout.native.graphs import default_batch_sizes
from caspo.rollout.native.kv_cache import CapacityReport, KVCache
from caspo.rollout.native.loading import build_runner, fused_modules, read_checkpoint, weights_dtype
from caspo.rollout.native.looped_runner import LoopedCausalLM
from caspo.rollout.native.model_runner import ModelRunner
from caspo.rollout.native.runner import CausalLM, decode_attention
from caspo.rollout.native.scheduler import Scheduler, SequenceState
from caspo.rollout.native.spec import LoopedSpec, decoder_spec
from caspo.rollout.publication import Publication, PublishedWeights
from caspo.rollout.stop_strings import StopStrings


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

    prefill_rounds: int = 0  # admissions, each a prefill of the requests admitted together
    prefill_tokens: int = 0  # prompt positions computed
    shared_tokens: int = 0  # prompt positions copied from a resident slot instead of computed
    prefill_forwards: int = 0  # forwards of the decoder over prompt pieces, each launched layer by layer
    decode_steps: int = 0
    grouped_steps: int = 0  # of those, steps that read shared prefixes once a group (shared_prefix_attention)
    decode_rows: int = 0  # rows the decode steps computed: the sequences decoded and a graph's padding rows
    generated_tokens: int = 0
    graph_captures: int = 0  # decode graphs captured (on first use of a shape, again after each wake)
    capture_s: float = 0.0  # host seconds spent capturing them
    # Where generate's host time goes: what is neither is the host's own work (scheduling, launches).
    generate_s: float = 0.0  # host seconds inside generate
    prefill_s: float = 0.0  # of those, in admission rounds: planning, K/V copies, launching forwards and samplers
    wait_s: float = 0.0  # of those, blocked until a decode step's tokens reached the host (the device is the bound)

    def since(self, before: "EngineStats") -> "EngineStats":
        """What happened between an earlier reading (`dataclasses.replace(stats)`) and this one."""
        return EngineStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


class NativeEngine(PublishedWeights):
    """Rollout engine over a native Qwen2/Llama runner, or the looped runner for a `caspo_looped` model.

    model: a live `transformers` Qwen2/Llama causal LM or `LoopedForCausalLM` (weights read from
        `named_parameters()`), or a `save_pretrained` folder (config.json + safetensors).
    max_seq_len: positions per sequence (prompt + max_new_tokens); the size of a cache slot.
    capacity_tokens / gpu_memory_fraction: the most the KV cache may take (exactly one; the fraction on CUDA only).
    max_running: sequences decoded at once; the cache then holds exactly that many slots (default: as many as fit).
    max_prefill_tokens: padded prompt positions per prefill forward; longer prompts are prefilled in pieces.
    admit_batch: waiting requests are admitted once this many slots are free (or all of them fit, or nothing
        runs), so that sequences finishing one or two a step (Monte Carlo continuations) cost one prefill
        round per batch of them rather than one per decode step (default: `default_admit_batch`).
    prefix_sharing: prompts sharing a prefix with a resident sequence copy its K/V instead of computing it.
    recompute_budget: prompt positions an admission round may compute again so that prompts extending one
        another (Monte Carlo continuations from successive step boundaries) prefill in one wave of forwards
        instead of one per link (0: always copy). A prefill forward is launched layer by layer; at the
        Qwen2.5-1.5B shape its host time is roughly the device time of 4,096 positions (an estimate,
        benchmarks/RESULTS.md).
    cuda_graphs: replay CUDA graphs of the decode step, captured per (rows, key length) on first use (CUDA only).
    sampler_graphs: with cuda_graphs, sample inside the decode step's graph (keyed by the sampling parameters
        too) and replay the sampler of freshly prefilled prompts as graphs of its own (false: launch the LM
        head and the sampler's kernels one by one after each graph; the same tokens).
    decode_kernel: decode attention through the split-K Triton kernel instead of masked SDPA
        (default: on CUDA; it reads each sequence's K/V once, where SDPA reads them at ~1/3 of the bandwidth).
    shared_prefix_attention: with decode_kernel, rows whose slots hold one prompt's K/V (copied by prefix
        sharing: the K continuations of a Monte Carlo prefix, the G samples of a prompt) read it once per
        decode step for all of them (`shared_prefix_attention.py`) instead of once each, in each step where
        that saves more reads than its extra kernels cost (`prefix_groups.worth_grouping`; default off).
    rope_kernel: RoPE and the K/V-cache write in one Triton kernel (`rope_store`) instead of eager
        RoPE and two indexed writes: the same numbers, one launch a layer instead of several (default: on
        CUDA; +4.6% rollout tokens/s on an H200, benchmarks/RESULTS.md).
    dtype / device: compute dtype and device (default: those of the weights).
    decode: token ids -> text, needed only for stop strings.
    """

    def __init__(self, model: nn.Module | str | os.PathLike, *, max_seq_len: int, capacity_tokens: int | None = None,
                 gpu_memory_fraction: float | None = None, max_running: int | None = None,
                 max_prefill_tokens: int = 8192, admit_batch: int | None = None, prefix_sharing: bool = True,
                 recompute_budget: int = 4096, cuda_graphs: bool = False, graph_batch_sizes: list[int] | None = None,
                 sampler_graphs: bool = True, decode_kernel: bool | None = None,
                 shared_prefix_attention: bool = False, rope_kernel: bool | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        config, tensors, source_device = _read_source(model)
        skeleton = any(t.is_meta for t in tensors.values())  # a rank of a sharded run that reads no weights
        if skeleton and device is None:
            raise ValueError("an engine built from a model's skeleton (on the meta device) needs device=")
        self.spec = decoder_spec(config)
        self.device = torch.device(device) if device is not None else source_device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this engine runs on {self.device}")
        self.dtype = dtype or weights_dtype(tensors)
        self.max_seq_len = max_seq_len
        runner_class = LoopedCausalLM if isinstance(self.spec, LoopedSpec) else CausalLM
        self.runner = build_runner(runner_class, self.spec, None if skeleton else tensors, dtype=self.dtype,
                                   device=self.device, max_seq_len=max_seq_len)
        del tensors
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # triton's CPU interpreter (tests)
        for name, asked, fallback in (("decode_kernel", decode_kernel, "masked SDPA"),
                                      ("rope_kernel", rope_kernel, "eager RoPE and indexed writes")):
            on = self.device.type == "cuda" if asked is None else asked
            if on and (decode_attention is None or not (self.device.type == "cuda" or interpreted)):
                raise ValueError(f"{name}=True needs triton and a CUDA device (device {self.device}, triton "
                                 f"{'missing' if decode_attention is None else 'present'}); "
                                 f"pass {name}=False for {fallback}")
            setattr(self.runner, name, on)
        if shared_prefix_attention and not (self.runner.decode_kernel and prefix_sharing):
            raise ValueError("shared_prefix_attention=True reads prompt K/V that prefix sharing copied, through the "
                             "decode kernel: it needs decode_kernel and prefix_sharing on")
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
        self.admit_batch = default_admit_batch(self.max_running) if admit_batch is None else admit_batch
        if not 1 <= self.admit_batch <= self.max_running:
            raise ValueError(f"admit_batch={admit_batch} must be in [1, max_running={self.max_running}]")
        self.prefix_sharing = prefix_sharing
        if recompute_budget < 0:
            raise ValueError(f"recompute_budget must be >= 0 (0: always copy), got {recompute_budget}")
        self.recompute_budget = recompute_budget
        self.graph_batch_sizes = None
        if cuda_graphs:
            self.graph_batch_sizes = sorted(set(graph_batch_sizes or default_batch_sizes(self.max_running)))
            if self.graph_batch_sizes[-1] < self.max_running:
                raise ValueError(f"graph_batch_sizes end at {self.graph_batch_sizes[-1]}, below "
                                 f"max_running={self.max_running}: larger decode batches would have no graph")
        self.decode = decode
        self._stop_checks: dict[tuple[str, ...], StopStrings] = {}
        self.version = 0
        self.stats = EngineStats()
        self._publication: Publication | None = None
        if skeleton:
            self.await_publication()
        self.model_runner = ModelRunner(self.runner, self.cache, self.spec, max_seq_len=max_seq_len,
                                        graph_batch_sizes=self.graph_batch_sizes, sampler_graphs=sampler_graphs,
                                        stats=self.stats, shared_prefix=shared_prefix_attention)

    # ------------------------------------------------------------ publication
    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.runner.named_parameters())

    def release_weights(self) -> None:
        """Free the weights, the fused q/k/v and gate/up buffers included (they are the parameters' storage)."""
        super().release_weights()
        for module in fused_modules(self.runner):
            module.unfuse()

    def reallocate_weights(self) -> None:
        """Storage for every released parameter, fused again: a publication's in-place copies land in the
        buffers the forward reads (without fusing again they would land in orphaned parameters)."""
        if self._released is None:
            return
        super().reallocate_weights()
        for module in fused_modules(self.runner):
            module.fuse()

    # ------------------------------------------------------------ memory
    def capacity_report(self) -> CapacityReport:
        return self.cache.capacity_report()

    @property
    def asleep(self) -> bool:
        return not self.cache.allocated

    def sleep(self, weights: bool = False) -> None:
        """Free the KV cache (and the graphs that point into it), and with `weights` the weights too."""
        self.model_runner.sleep(release=self.release_weights if weights else None)

    def wake(self) -> None:
        """Allocate the KV cache (and released weights) again, and recapture the graphs."""
        self.reallocate_weights()
        self.model_runner.wake()

    # ------------------------------------------------------------ generation
    def generate(self, requests: Sequence[Request], sampling: SamplingParams, *, top_logprobs: int = 0,
                 on_finish: OnFinish | None = None) -> list[NativeCompletion]:
        self._check(requests, sampling, top_logprobs)
        with torch.no_grad():
            return self._generate(list(requests), sampling, top_logprobs, on_finish)

    def _check(self, requests: Sequence[Request], sampling: SamplingParams, top_logprobs: int) -> None:
        if self.asleep:
            raise asleep_error("generate()")
        self.check_weights()
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

    def _stop_strings(self, strings: list[str]) -> StopStrings | None:
        """The check of these stop strings, kept across calls: each token's text is decoded once an engine."""
        if not strings:
            return None
        key = tuple(strings)
        if key not in self._stop_checks:
            self._stop_checks[key] = StopStrings(strings, self.decode)
        return self._stop_checks[key]

    def _generate(self, requests: list[Request], sp: SamplingParams, top_logprobs: int,
                  on_finish: OnFinish | None) -> list[NativeCompletion]:
        results: list[NativeCompletion | None] = [None] * len(requests)
        scheduler = Scheduler(requests, slots=self.max_running, prefix_sharing=self.prefix_sharing,
                              max_prefill_tokens=self.max_prefill_tokens, sampling=sp,
                              stop_strings=self._stop_strings(sp.stop_strings),
                              admit_batch=self.admit_batch, recompute_budget=self.recompute_budget)
        upcoming = None  # the next tokens of scheduler.running, sampled by the last decode step
        started = time.perf_counter()
        while not scheduler.done:
            admitted = scheduler.admit()
            picked = upcoming
            if admitted:
                admitting = time.perf_counter()
                plan = scheduler.plan_prefill(admitted)
                self.stats.prefill_rounds += 1
                self.stats.shared_tokens += sum(wave.shared_tokens for wave in plan)
                self.stats.prefill_tokens += sum(wave.computed_tokens for wave in plan)
                self.stats.prefill_forwards += sum(len(wave.forwards) for wave in plan)
                fresh = self.model_runner.sample(admitted, self.model_runner.prefill(plan, admitted), sp, top_logprobs)
                picked = fresh if picked is None else picked.join(fresh)
                self.stats.prefill_s += time.perf_counter() - admitting
            # Decode ahead: the next step runs (and samples) on the device while the host reads this step's
            # tokens. Sequences at their last token are left out; one that stops on a token wastes a row.
            ahead, decoded = scheduler.decoding(), None
            if ahead:
                decoded = self.model_runner.decode(ahead, picked.tokens, scheduler.running, sp)
                self.stats.decode_steps += 1
            self.stats.generated_tokens += len(scheduler.running)
            waiting = time.perf_counter()
            tokens = picked.read()
            self.stats.wait_s += time.perf_counter() - waiting
            for seq in scheduler.postprocess(tokens):
                results[seq.index] = self._completion(seq, top_logprobs)
                if on_finish is not None:
                    on_finish(seq.index, results[seq.index])
            # Whoever still runs was decoded ahead: a sequence left out was at its last token and finished.
            slots = [s.slot for s in scheduler.running]
            upcoming = decoded.picked(slots, top_logprobs) if slots else None
        self.stats.generate_s += time.perf_counter() - started
        return results

    def _completion(self, seq: SequenceState, top_logprobs: int) -> NativeCompletion:
        return NativeCompletion(seq.tokens, seq.logprobs, seq.finish_reason, self.version, seq.logprobs_full,
                                seq.top if top_logprobs else None)

    # ------------------------------------------------------------ scoring
    def teacher_forced_logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Float32 logits [len, vocab] at every position of each token sequence, through the prefill path.

        Uses the cache's slots as scratch space, up to max_running sequences per forward.
        """
        if self.asleep:
            raise asleep_error("teacher_forced_logits()")
        self.check_weights()
        if any(not 0 < len(s) <= self.max_seq_len for s in sequences):
            raise ValueError(f"every sequence needs 1..max_seq_len={self.max_seq_len} tokens")
        with torch.no_grad():
            return self.model_runner.teacher_forced_logits(sequences)


def default_admit_batch(max_running: int) -> int:
    """An eighth of the slots, from 1 to 64. Each admission round costs about the same host time whatever its
    size, so the best batch measured was about the same at 420 slots (54 and 64, 4-5% faster than 27) and at
    1,024 (64, faster than 128 and 256): benchmarks/RESULTS.md, tenth, thirty-seventh and thirty-eighth series."""
    return min(64, max(1, max_running // 8))


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
