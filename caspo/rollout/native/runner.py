"""A plain-PyTorch decoder of the Qwen2/Qwen2.5 and Llama families over an engine-owned KV cache.

Modules carry the Hugging Face parameter names (`model.layers.3.self_attn.q_proj.weight`, ...),
so checkpoints load by name and a publication of the trainer's `named_parameters()` maps one
to one. The numerics follow `transformers`: RMSNorm in float32, RoPE tables computed in
float32 on the model's device and cast to the compute dtype. Logits are float32: on CUDA a
bf16/fp16 runner keeps the output GEMM's float32 accumulator, where `transformers` rounds
the logits to the compute dtype first.

On CUDA four things differ from a plain eager forward, none in what is computed: q/k/v and
gate/up each run as one GEMM over a fused weight whose row blocks are the named parameters
(`fuse_linears`); a decode step's down projection leaves float32 partials over spans of K for the
next norm's kernel to sum (`split_linear`, `down_splits`); the element-wise work between GEMMs
runs through `torch.compile` (`compiled_on_cuda`); and a decode step's attention runs in the
split-K Triton kernel of `decode_attention.py` (`Runner.decode_kernel`, set by the engine).
RoPE and the K/V-cache write run as one Triton kernel on CUDA (`rope_store.py`,
`Runner.rope_kernel`, set by the engine's `rope_kernel`); in a decode step that kernel is the
attention kernel's prologue where one program reads a row's whole key range
(`rope_attention.py`). Each layer's residual add after its MLP runs in the next norm's kernel
(`DecoderLayer.deferred`).

A prefill of whole prompts (every row from position 0, as teacher forcing is too) attends under SDPA's own causal
mask (`causal_attention`: flash on CUDA); prompt pieces that start later, under a boolean mask
(`grouped_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from caspo.rollout.native.kv_cache import KVCache
from caspo.rollout.native.linears import down_splits, fuse_linears, gate_up_config, settled, split_linear
from caspo.rollout.native.prefix_groups import PrefixGroups
from caspo.rollout.native.spec import DecoderSpec

try:
    from caspo.rollout.native.decode_attention import decode_attention
    from caspo.rollout.native.gate_up_silu import gate_up_silu
    from caspo.rollout.native.rope_attention import rope_decode_attention
    from caspo.rollout.native.rope_store import rope_store
    from caspo.rollout.native.shared_prefix_attention import shared_prefix_decode_attention
except ImportError:  # CPU builds of torch come without triton; the engine refuses the kernels then
    decode_attention = rope_decode_attention = rope_store = shared_prefix_decode_attention = gate_up_silu = None


@dataclass
class Batch:
    """Where the query tokens of one forward live in the cache, and which keys each of them sees."""

    slots: torch.Tensor  # [B] cache slot of each row
    positions: torch.Tensor  # [B, T] cache position (= RoPE position) of each query token
    mask: torch.Tensor | None  # [B, 1, groups·T, key_len] bool, laid out for grouped_attention; None: see causal
    key_len: int  # keys [0, key_len) of each slot are read
    rows_are_slots: bool  # slots == arange(B): the keys are a view of the cache, no gather
    lengths: torch.Tensor | None = None  # [B] keys seen by each row: set for the split-K decode kernel
    rope_kernel: bool = False  # RoPE and the K/V write through `rope_store`
    groups: PrefixGroups | None = None  # rows sharing prompt K/V, each group's read once (decode kernel only)
    causal: bool = False  # every row's queries are positions 0..T-1 over keys [0, T): SDPA's own causal mask

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor, key_len: int, groups: int,
              rows_are_slots: bool = False, rope_kernel: bool = False, from_zero: bool = False) -> "Batch":
        """from_zero: the caller's promise that positions[b] = 0..T-1 for every row and key_len = T (whole prompts,
        padded at their ends); attention then needs no mask tensor."""
        if from_zero:
            if key_len != positions.shape[1]:
                raise ValueError(f"from_zero needs key_len = T = {positions.shape[1]}, got {key_len}")
            return cls(slots, positions, None, key_len, rows_are_slots, rope_kernel=rope_kernel, causal=True)
        keys = torch.arange(key_len, device=positions.device)
        causal = keys[None, None, :] <= positions[:, :, None]  # [B, T, L]
        return cls(slots, positions, causal.repeat(1, groups, 1)[:, None], key_len, rows_are_slots,
                   rope_kernel=rope_kernel)

    @classmethod
    def decode(cls, positions: torch.Tensor, slots: torch.Tensor, key_len: int, groups: int, kernel: bool,
               rope_kernel: bool = False, prefix_groups: PrefixGroups | None = None) -> "Batch":
        """One query token per row, row i in slot slots[i]; `kernel`: for decode_attention (no mask needed),
        reading the prompt K/V of each of `prefix_groups` once."""
        if kernel:
            return cls(slots, positions[:, None], None, key_len, False, lengths=positions + 1, rope_kernel=rope_kernel,
                       groups=prefix_groups)
        if prefix_groups is not None:
            raise ValueError("shared-prefix groups need the decode kernel (decode_kernel=True)")
        return cls.build(slots, positions[:, None], key_len, groups, rope_kernel=rope_kernel)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        if self.rows_are_slots:
            return cache[: self.slots.shape[0], :, : self.key_len]
        return cache[self.slots, :, : self.key_len]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA for grouped-query attention without repeating K/V.

    q [B, T, H, D]; k, v [B, Hkv, L, D]; mask [B, 1, g·T, L]. The g = H / Hkv query heads of one
    KV head are folded into the query length, so each KV head is read once, by any SDPA backend.
    Returns [B, T, H·D].
    """
    B, T, H, D = q.shape
    kv_heads = k.shape[1]
    groups = H // kv_heads
    q = q.view(B, T, kv_heads, groups, D).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, groups * T, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(B, kv_heads, groups, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of queries q [B, T, H, D] at positions 0..T-1 over keys k, v [B, Hkv, T, D], causally.

    No mask tensor, so on CUDA SDPA takes its flash kernel, which reads each KV head once for its H / Hkv query
    heads (enable_gqa) and works in q's [B, T, H, D] layout: no copies in or out, where `grouped_attention`'s
    mask sends it to the memory-efficient kernel behind two layout copies (benchmarks/RESULTS.md). Returns
    [B, T, H·D].
    """
    B, T, H, D = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(B, T, H * D)


def compiled_on_cuda(fn):
    """`fn` through torch.compile when its first argument is on CUDA, eager elsewhere.

    For the element-wise work between the GEMMs (RMSNorm, RoPE, SiLU·up): eager runs it as about
    ten kernels per layer, a third of a decode step at the Qwen2.5-1.5B shape on an H200; compiled
    it fuses into three. Leading dimensions (rows, tokens) are dynamic, so one compilation serves
    every decode batch and one every prefill; `emulate_precision_casts` keeps eager's roundings.
    """
    compiled = torch.compile(fn, options={"emulate_precision_casts": True})

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args):
        if not x.is_cuda:
            return fn(x, *args)
        for dim in range(x.dim() - 1):
            torch._dynamo.maybe_mark_dynamic(x, dim)
        return compiled(x, *args)

    return run


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@compiled_on_cuda
def rotary_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: tuple[int, int, int],
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, T, heads, head_dim] of the fused projection [B, T, Σ split], RoPE applied to q and k
    (the path without the Triton kernels; `rope_store` computes the same numbers)."""
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(split, dim=-1))
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, rounded to x's dtype, then scaled."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


rms_norm = compiled_on_cuda(_rms_norm)


@compiled_on_cuda
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm in one kernel (with the sum of
    delta's partials, where it comes as `split_linear`'s)."""
    x = x + settled(delta, x)
    return x, _rms_norm(x, weight, eps)


@compiled_on_cuda
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        self.head_dim = spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.q_proj = nn.Linear(spec.hidden_size, q_size, bias=spec.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False, dtype=dtype)

    def fuse(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def unfuse(self) -> None:
        """Drop the fused buffer (the parameters' storage): after the parameters are freed, it holds the weights."""
        self.qkv_weight = self.qkv_bias = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: Batch,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """rope: `Runner.rope(batch)`, the (cos, sin) tables or their rows at the batch's positions."""
        B, T, _ = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        cache_k, cache_v = kv
        heads = self.split[0] // self.head_dim
        if batch.rope_kernel and batch.lengths is not None and batch.groups is None:  # a decode step, one launch
            out = rope_decode_attention(qkv[:, 0], *rope, batch.positions[:, 0], batch.lengths, batch.slots,
                                        batch.key_len, cache_k, cache_v, heads)
            return self.o_proj(out.reshape(B, 1, -1))
        # Write first, then read: a token attends to itself and to every earlier position of its slot.
        if batch.rope_kernel:
            q = rope_store(qkv, *rope, batch.positions, batch.slots, cache_k, cache_v, heads)
        else:
            q, k, v = rotary_split(qkv, *rope, self.split, self.head_dim)
            cache_k[batch.slots[:, None], :, batch.positions] = k
            cache_v[batch.slots[:, None], :, batch.positions] = v
        if batch.groups is not None:
            out = shared_prefix_decode_attention(q[:, 0], cache_k, cache_v, batch.lengths, batch.key_len, batch.slots,
                                                 batch.groups)
            return self.o_proj(out.reshape(B, 1, -1))
        if batch.lengths is not None:
            out = decode_attention(q[:, 0], cache_k, cache_v, batch.lengths, batch.key_len, batch.slots)
            return self.o_proj(out.reshape(B, 1, -1))
        k, v = batch.read(cache_k), batch.read(cache_v)
        if batch.causal:
            return self.o_proj(causal_attention(q, k, v))
        return self.o_proj(grouped_attention(q, k, v, batch.mask))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False, dtype=dtype)

    def fuse(self) -> None:
        self.gate_up_weight, _ = fuse_linears([self.gate_proj, self.up_proj])

    def unfuse(self) -> None:
        self.gate_up_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(F.linear(x, self.gate_up_weight)))

    def deferred(self, x: torch.Tensor) -> torch.Tensor:
        """The output for the next norm's kernel: `forward`'s, or on CUDA at a decode step's rows the down
        projection's float32 partials over spans of K (`down_splits`), which that kernel sums (`settled`)."""
        rows, tuned = x.numel() // x.shape[-1], x.is_cuda and x.dtype != torch.float32  # the tables are for the card
        config = None
        if tuned and gate_up_silu is not None:  # CUDA builds of torch without triton keep cuBLAS + silu_mul
            capability = torch.cuda.get_device_capability(x.device)[0]
            config = gate_up_config(rows, x.shape[-1], self.gate_up_weight.shape[0] // 2, capability)
        if config is None:
            hidden = silu_mul(F.linear(x, self.gate_up_weight))
        else:  # a decode step's rows where SiLU·up in the GEMM's epilogue was measured faster
            hidden = gate_up_silu(x.reshape(rows, -1), self.gate_up_weight, config).view(*x.shape[:-1], -1)
        depth = hidden.shape[-1]
        splits = down_splits(rows, depth) if tuned else 1
        if splits == 1:
            return self.down_proj(hidden)
        return split_linear(hidden, self.down_proj.weight, splits)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(spec, dtype)
        self.mlp = MLP(spec, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(self, x, rope, batch: Batch, kv) -> torch.Tensor:
        """The layer on its own (as the looped decoder runs its layers): x after both residual adds."""
        x, h = self.attend(x, None, rope, batch, kv)
        return x + self.mlp(h)

    def attend(self, x, delta, rope, batch: Batch, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream after the attention block, the MLP's normed input); `delta` is the previous
        layer's MLP output, which this layer's first norm adds to x (None: x is complete)."""
        norm = self.input_layernorm
        if delta is None:
            h = norm(x)
        else:
            x, h = add_rms_norm(x, delta, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        return add_rms_norm(x, self.self_attn(h, rope, batch, kv), norm.weight, norm.eps)

    def deferred(self, x, delta, rope, batch: Batch, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its residual adds in the norms' kernels: (x, this layer's MLP output, `MLP.deferred`),
        for x + delta to be taken by the next norm; `delta` is the previous layer's (None for the first)."""
        x, h = self.attend(x, delta, rope, batch, kv)
        return x, self.mlp.deferred(h)


class Backbone(nn.Module):
    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class Runner(nn.Module):
    """What the engine calls on a decoder: `forward` (prefill), `decode`, `logits`.

    Subclasses build `self.model` (with `embed_tokens` and `norm`) and implement `forward`.
    """

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        self.rope_cos = self.rope_sin = None
        self.decode_kernel = False  # decode attention through the split-K Triton kernel (set by the engine)
        self.rope_kernel = False  # RoPE and the K/V write through rope_store (set by the engine)

    def init_rope(self, max_seq_len: int) -> None:
        """cos/sin of every cache position, computed the way transformers computes them per forward."""
        inv_freq = self.spec.rope_inv_freq.to(self.model.norm.weight.device)
        freqs = torch.arange(max_seq_len, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self.model.norm.weight.dtype
        self.rope_cos = (angles.cos() * self.spec.rope_attention_scaling).to(dtype)
        self.rope_sin = (angles.sin() * self.spec.rope_attention_scaling).to(dtype)

    def rope(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for every layer of a forward: the tables [max_seq_len, head_dim] for `rope_store`, which
        reads the positions itself, else their rows at the batch's positions [B, T, 1, head_dim], gathered once."""
        if batch.rope_kernel:
            return self.rope_cos, self.rope_sin
        return self.rope_cos[batch.positions][:, :, None], self.rope_sin[batch.positions][:, :, None]

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
               key_len: int, prefix_groups: PrefixGroups | None = None) -> torch.Tensor:
        """One token for each row, row i in cache slot slots[i]: hidden states [B, hidden]."""
        batch = Batch.decode(positions, slots, key_len, self.spec.kv_groups, self.decode_kernel, self.rope_kernel,
                             prefix_groups)
        return self(tokens[:, None], batch, cache)[:, 0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits. A bf16/fp16 runner on CUDA keeps the GEMM's float32 accumulator instead of
        rounding it to the compute dtype (which moves a logit near 4 by up to 0.016)."""
        if hidden.is_cuda and hidden.dtype != torch.float32:
            flat = torch.mm(hidden.flatten(0, -2), self.output_weight.t(), out_dtype=torch.float32)
            return flat.view(*hidden.shape[:-1], -1)
        return F.linear(hidden, self.output_weight).float()


class CausalLM(Runner):
    """The Qwen2/Llama decoder. Build it with `build_runner(CausalLM, spec, ...)`."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype):
        super().__init__(spec, dtype)
        self.model = Backbone(spec, dtype)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache, plane: int = 0) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden] of `tokens` [B, T]; writes their K/V into `cache`."""
        x, delta = self.model.embed_tokens(tokens), None
        rope = self.rope(batch)
        for index, layer in enumerate(self.model.layers):
            x, delta = layer.deferred(x, delta, rope, batch, cache.layer(plane, index))
        norm = self.model.norm
        return add_rms_norm(x, delta, norm.weight, norm.eps)[1]
