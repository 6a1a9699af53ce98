"""A fixed-depth recurrent ("looped") causal LM: one stack of L physical layers run `depth` times.

    h_0 = Embed(x); h_t = RMSNorm_final(Block_L(…Block_1(h_{t−1}))), t = 1..T; logits = LMHead(h_T)

Layouts "ouro" (sandwich norms) and "nanbeige" (pre-norm Llama). Ouro's exit gate is built (its
weights load and save) but frozen and never evaluated: logits and loss use the last loop. KV cache:
loop t, layer l uses plane t·L + l (`LoopedCache`). Importing this module registers `model_type:
"caspo_looped"` with the Auto classes (critic: `LoopedForValue`). See docs/looped.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    DynamicCache,
    GenerationMixin,
    PreTrainedConfig,
)
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput

from caspo.models.looped_layers import Block, RMSNorm, causal_mask, rope

LAYOUTS = ("ouro", "nanbeige")


# transformers renamed the cache field of model outputs from `past_key_values` to `cache`
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def keep_last(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions the LM head runs on: the last `n` (0 = all), or the given indices."""
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return hidden[:, logits_to_keep]


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
        if self.id2label is None:
            kwargs.setdefault("num_labels", 1)  # the only non-LM head is the scalar value head
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


# ---------------------------------------------------------------------------- models


class LoopedPreTrainedModel(PreTrainedModel):
    config_class = LoopedConfig
    config: LoopedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _supports_sdpa = True  # attention always runs through torch SDPA ("eager" is the same computation)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Loading replaces parameters (and their requires_grad), so the exit gate is frozen again."""
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).base_model.freeze_exit_gate()
        return loaded

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1):
        """Called by `activation_checkpointing_enable()` / `gradient_checkpointing_enable()`. Only
        non-reentrant checkpointing of every block is implemented; other options raise."""
        options = getattr(gradient_checkpointing_func, "keywords", {})
        func = getattr(gradient_checkpointing_func, "func", gradient_checkpointing_func)
        plain = func in (None, torch.utils.checkpoint.checkpoint)
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
        return BaseModelOutputWithPast(last_hidden_state=x, **{CACHE_FIELD: cache},
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
        logits = self.lm_head(keep_last(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_FIELD: getattr(out, CACHE_FIELD)})

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
    values: torch.Tensor | None = None  # [B, T]: V_t, the value after reading tokens 1..t
    logits: torch.Tensor | None = None  # [B, T, 1]: the same, shaped like a one-label token classifier's
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class LoopedForValue(LoopedPreTrainedModel):
    """The critic of a looped policy: the same trunk with the LM head replaced by
    score = Linear(hidden, 1, bias=False), so V_t = w·h_T(t).

    It is registered as the looped `AutoModelForTokenClassification` (one label, head named
    `score`), so critic code written for HF token classifiers loads it from a policy checkpoint:
    `lm_head` is dropped and `score` starts fresh."""

    def __init__(self, config: LoopedConfig):
        if config.num_labels != 1:
            raise ValueError(f"a looped value model has one output; got num_labels={config.num_labels}")
        super().__init__(config)
        self.model = LoopedModel(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()
        self.model.freeze_exit_gate()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache: bool | None = False, output_hidden_states: bool | None = None,
                past_key_values: Cache | None = None, **kwargs) -> LoopedValueOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=pick_cache(cache, past_key_values), inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, **kwargs)
        logits = self.score(out.last_hidden_state)
        return LoopedValueOutput(values=logits.squeeze(-1), logits=logits, cache=getattr(out, CACHE_FIELD),
                                 hidden_states=out.hidden_states)


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
AutoModelForTokenClassification.register(LoopedConfig, LoopedForValue, exist_ok=True)

__all__ = ["LoopedConfig", "LoopedCache", "LoopedModel", "LoopedForCausalLM", "LoopedForValue", "LoopedValueOutput"]
