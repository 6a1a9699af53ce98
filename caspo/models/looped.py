"""A fixed-depth recurrent ("looped") causal LM: one stack of L physical layers run `depth` times.

Importing this module registers the model with the `transformers` Auto classes, so a saved
checkpoint (`model_type: "caspo_looped"`) loads through `AutoModelForCausalLM.from_pretrained`,
e.g. through `caspo.models.policy.load_policy`, once `caspo.models.looped` has been imported.

Forward pass, for tokens x_1..x_n with the same RoPE positions in every loop:

    h_0 = Embed(x)
    for t = 1..T:                      # T = config.depth
        z = h_{t-1}
        for l = 1..L:  z = Block_l(z)  # the same L blocks in every loop
        h_t = RMSNorm_final(z)         # the normed state replaces the stream
    logits = LMHead(h_T)

Two block layouts (`config.layout`):

    "ouro"      sandwich norms:  z ← z + N2(Attn(N1 z));  z ← z + N4(MLP(N3 z))
                (Ouro-1.4B / 2.6B; N1..N4 = input_layernorm, input_layernorm_2,
                post_attention_layernorm, post_attention_layernorm_2)
    "nanbeige"  pre-norm Llama:  z ← z + Attn(N1 z);      z ← z + MLP(N3 z)
                (Nanbeige4.2; GQA, and q/o may be non-square: heads·head_dim ≠ hidden)

MLP(z) = W_down(silu(W_gate z) ⊙ W_up z). Attention is causal softmax(q kᵀ/√d) v with RoPE.

Ouro's exit gate λ_t = σ(w·h_t + b) defines an exit distribution over loops
(p_t = λ_t ∏_{j<t}(1−λ_j) for t<T, p_T = ∏_{j<T}(1−λ_j)). At fixed depth with exit
threshold 1.0 the logits come from the last loop, so the gate is built (its weights load and
save) but frozen (requires_grad False) and never evaluated.

KV cache ("recurrence planes"): each (loop t, layer l) has its own keys/values in plane
t·L + l, and loop t attends only to loop-t keys/values of earlier tokens. `LoopedCache` holds
the T·L planes; a lazily growing `transformers.DynamicCache()` works as well.

Recompute: with `config.recompute` or `model.gradient_checkpointing_enable()`, every block
call in every loop runs under non-reentrant `torch.utils.checkpoint` while gradients are on.

The parameter names follow the upstream HF remote code of Ouro and the Llama-style names of
Nanbeige4.2, so upstream state dicts map onto this model one-to-one (see
`caspo.models.looped_upstream`). Loading the released Ouro-1.4B / Nanbeige4.2-3B weights is
unverified: only small fixtures saved under the upstream names have been loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationMixin, PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils import ModelOutput

LAYOUTS = ("ouro", "nanbeige")


class LoopedConfig(PreTrainedConfig):
    """Hyper-parameters of a looped LM. `depth` is the number of loops T (Ouro's
    `total_ut_steps`, Nanbeige's `num_loops`); `num_hidden_layers` counts physical layers L."""

    model_type = "caspo_looped"
    keys_to_ignore_at_inference = ["cache"]

    layout: str = "ouro"
    depth: int = 4
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    recompute: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size is not a multiple of num_attention_heads; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; use one of {LAYOUTS}")
        if self.depth < 1:
            raise ValueError(f"depth={self.depth}; a looped model runs its layers at least once")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("RoPE needs an even head_dim")
        super().__post_init__(**kwargs)

    @property
    def num_planes(self) -> int:
        """KV-cache planes: one per (loop, physical layer)."""
        return self.depth * self.num_hidden_layers


# ---------------------------------------------------------------------------- cache


class LoopedCache(DynamicCache):
    """A dynamic KV cache with one plane per (loop t, layer l), at index t·L + l.

    Every plane holds [batch, kv_heads, tokens, head_dim] keys and values; all planes always
    hold the same number of tokens, so `get_seq_length()` (plane 0) is the cached length.
    """

    def __init__(self, config: LoopedConfig):
        Cache.__init__(self, layers=[DynamicLayer() for _ in range(config.num_planes)])
        self.depth = config.depth
        self.num_layers = config.num_hidden_layers

    def plane(self, loop: int, layer: int) -> int:
        return loop * self.num_layers + layer


def check_cache(cache: Cache, config: LoopedConfig) -> None:
    """Raise unless `cache` can hold this model's T·L planes."""
    if isinstance(cache, LoopedCache):
        if (cache.depth, cache.num_layers) != (config.depth, config.num_hidden_layers):
            raise ValueError(f"LoopedCache for depth {cache.depth} × {cache.num_layers} layers, "
                             f"model has depth {config.depth} × {config.num_hidden_layers} layers")
        return
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    grows = getattr(cache, "layer_class_to_replicate", None) is DynamicLayer
    if not ((grows and len(cache.layers) == 0) or len(cache.layers) == config.num_planes):
        raise ValueError(f"a {type(cache).__name__} with {len(cache.layers)} layers cannot hold the "
                         f"{config.num_planes} recurrence planes; pass LoopedCache(config) or DynamicCache()")


# ---------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """y = w ⊙ x / sqrt(mean(x²) + ε), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of angle p·θ^(−2i/d) for i < d/2, each repeated to [B, T, d] (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float) / head_dim)
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ⊙ cos + rotate_half(x) ⊙ sin, with x of shape [B, heads, T, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class Attention(nn.Module):
    """Causal GQA attention; kv head j serves query heads j·G .. j·G+G−1 (G = heads / kv_heads)."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x, cos, sin, mask, cache: Cache | None, plane: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, plane)  # this plane's keys/values of all tokens so far
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    """W_down(act(W_gate x) ⊙ W_up x)."""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """ouro:     z ← z + N2(Attn(N1 z));  z ← z + N4(MLP(N3 z))
    nanbeige: z ← z + Attn(N1 z);      z ← z + MLP(N3 z)"""

    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N1
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N3
        self.sandwich = cfg.layout == "ouro"
        if self.sandwich:
            self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N2
            self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # N4

    def forward(self, z, cos, sin, mask, cache: Cache | None, plane: int):
        a = self.self_attn(self.input_layernorm(z), cos, sin, mask, cache, plane)
        z = z + (self.input_layernorm_2(a) if self.sandwich else a)
        m = self.mlp(self.post_attention_layernorm(z))
        return z + (self.post_attention_layernorm_2(m) if self.sandwich else m)


def causal_mask(attention_mask: torch.Tensor | None, B: int, T: int, past: int, dtype, device) -> torch.Tensor:
    """Additive [B, 1, T, past+T] mask: query i (absolute index past+i) sees key j iff j ≤ past+i and
    attention_mask[b, j] = 1. Blocked entries get the dtype's most negative value (not −inf), so a
    fully padded query row yields finite, ignorable outputs instead of NaN."""
    S = past + T
    keys = torch.arange(S, device=device)
    allowed = (keys[None, :] <= past + torch.arange(T, device=device)[:, None])[None, None]
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask must be [batch, past+new] = [{B}, {S}], got {tuple(attention_mask.shape)}")
        allowed = allowed & attention_mask[:, None, None, :].bool()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min).expand(B, 1, T, S)


# ---------------------------------------------------------------------------- models


class LoopedPreTrainedModel(PreTrainedModel):
    config_class = LoopedConfig
    config: LoopedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint,
                                    every_n_layers: int = 1):
        """Only non-reentrant checkpointing of every block is implemented; anything else raises."""
        options = getattr(gradient_checkpointing_func, "keywords", {})
        plain = getattr(gradient_checkpointing_func, "func", gradient_checkpointing_func) is checkpoint
        if enable and (every_n_layers != 1 or not plain or options.get("use_reentrant", False)
                       or set(options) - {"use_reentrant"}):
            raise NotImplementedError("looped models checkpoint every block, non-reentrant, without offload "
                                      f"(got every_n_layers={every_n_layers}, options={options})")
        self.base_model.gradient_checkpointing = enable


class LoopedModel(LoopedPreTrainedModel):
    """Embedding, the L shared blocks run `depth` times, the final norm after every loop."""

    def __init__(self, config: LoopedConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layout == "ouro":
            self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.gradient_checkpointing = False
        self.post_init()
        self.freeze_exit_gate()

    def freeze_exit_gate(self) -> None:
        if hasattr(self, "early_exit_gate"):
            self.early_exit_gate.requires_grad_(False)

    def recompute_active(self) -> bool:
        return (self.config.recompute or self.gradient_checkpointing) and torch.is_grad_enabled()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache: bool | None = None, output_hidden_states: bool | None = None,
                past_key_values: Cache | None = None, **kwargs) -> BaseModelOutputWithPast:
        """`last_hidden_state` is h_T; with `output_hidden_states`, `hidden_states` is (h_0, h_1, .., h_T)."""
        reject_unknown(kwargs)
        cache = pick_cache(cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape

        recompute = self.recompute_active()
        if use_cache is None:
            use_cache = self.config.use_cache and not recompute
        if use_cache and cache is None:
            cache = LoopedCache(self.config)
        if cache is not None:
            if recompute:
                raise ValueError("recompute re-runs blocks in backward and would append to the KV cache "
                                 "twice; call with use_cache=False and no cache")
            check_cache(cache, self.config)
        past = cache.get_seq_length() if cache is not None else 0

        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None].expand(B, T)
        cos, sin = rope(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        mask = causal_mask(attention_mask, B, T, past, x.dtype, x.device)

        states = [x] if output_hidden_states else None
        L = self.config.num_hidden_layers
        for t in range(self.config.depth):
            for l, block in enumerate(self.layers):
                if recompute:
                    x = checkpoint(block, x, cos, sin, mask, None, t * L + l, use_reentrant=False)
                else:
                    x = block(x, cos, sin, mask, cache, t * L + l)
            x = self.norm(x)  # h_t: feeds the next loop, the gate and the head
            if states is not None:
                states.append(x)
        return BaseModelOutputWithPast(last_hidden_state=x, cache=cache,
                                       hidden_states=tuple(states) if states is not None else None)


class LoopedForCausalLM(LoopedPreTrainedModel, GenerationMixin):
    """logits = LMHead(h_T): the last loop's logits at fixed depth."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # used only if tie_word_embeddings

    def __init__(self, config: LoopedConfig):
        super().__init__(config)
        self.model = LoopedModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.model.freeze_exit_gate()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                output_hidden_states: bool | None = None, past_key_values: Cache | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=pick_cache(cache, past_key_values), inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate()` decodes with a LoopedCache; other cache implementations are refused."""
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported "
                             "by looped models; leave it unset")
        model_kwargs["cache"] = LoopedCache(self.config)


@dataclass
class LoopedValueOutput(ModelOutput):
    values: torch.Tensor | None = None  # [B, T]: V(prefix up to and including token t)
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class LoopedForValue(LoopedPreTrainedModel):
    """The critic of a looped policy: the same trunk, with the LM head replaced by
    value_head = Linear(hidden, 1, bias=False), so V_t = w·h_T(t). Loading a policy checkpoint
    into it drops `lm_head` and initialises `value_head` fresh."""

    def __init__(self, config: LoopedConfig):
        super().__init__(config)
        self.model = LoopedModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()
        self.model.freeze_exit_gate()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache: bool | None = False, output_hidden_states: bool | None = None,
                past_key_values: Cache | None = None, **kwargs) -> LoopedValueOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=pick_cache(cache, past_key_values), inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, **kwargs)
        values = self.value_head(out.last_hidden_state).squeeze(-1)
        return LoopedValueOutput(values=values, cache=out.cache, hidden_states=out.hidden_states)


# ---------------------------------------------------------------------------- helpers

def reject_unknown(kwargs: dict) -> None:
    """Raise on keyword arguments this model does not implement (only their no-op values pass)."""
    unknown = sorted(k for k, v in kwargs.items()
                     if not ((k == "output_attentions" and not v) or (k == "return_dict" and v in (None, True))))
    if unknown:
        raise TypeError(f"looped models do not support {unknown}")


def pick_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache travels as `cache` (current transformers) or `past_key_values` (older name)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the KV cache as either `cache` or `past_key_values`, not both")
    return cache if cache is not None else past_key_values


AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopedConfig, LoopedForCausalLM, exist_ok=True)

from caspo.models.looped_upstream import from_upstream_config, load_upstream, map_upstream_state_dict  # noqa: E402

__all__ = ["LoopedConfig", "LoopedCache", "LoopedModel", "LoopedForCausalLM", "LoopedForValue", "LoopedValueOutput",
           "from_upstream_config", "map_upstream_state_dict", "load_upstream"]
