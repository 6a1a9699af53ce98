"""What the native runner implements of a Hugging Face config, checked once at load.

The runner implements the Qwen2/Qwen2.5 and Llama decoder families; the looped runner implements
our fixed-depth recurrent LM (`model_type: caspo_looped`, `caspo.models.looped`). Every config
key that changes the computation is read here, and a value the runners do not implement raises
`UnsupportedModelError` naming the key: a model never runs with a silent difference from
`transformers` (for a looped model: from `LoopedForCausalLM`). A Qwen2/Llama config key that is
neither read nor listed as inert (`INERT`) is refused too, so a key a newer `transformers` adds
cannot pass unread.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from caspo.models.looped import LAYOUTS as LOOPED_LAYOUTS
from caspo.models.looped import LoopedConfig

FAMILIES = ("qwen2", "llama")
# Importing the looped model registers it with AutoConfig, so its checkpoint folders load too.
LOOPED = LoopedConfig.model_type
# RoPE variants of these families whose frequencies are fixed at load. "dynamic" and
# "longrope" change the frequencies with the length of the sequences in the batch, which
# would make a completion depend on what it is batched with.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Qwen2/Llama config keys that `decoder_spec` reads and checks.
READ = frozenset({
    "model_type", "quantization_config", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
    "vocab_size", "rope_parameters", "layer_types", "use_sliding_window", "attention_bias", "mlp_bias",
})
# Keys that do not change what the runner computes.
INERT = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "attention_dropout",  # dropout acts in training only
    "max_position_embeddings",  # positions are not capped; the scaled RoPE variants read it from the config
    "pretraining_tp",  # transformers 5 ignores it
    "sliding_window", "max_window_layers",  # only with use_sliding_window / sliding layer_types, refused
})
# Keys a checkpoint may carry that the config class does not define, with the one value the runner computes.
EXTRA_KEYS = {"use_mrope": False}  # Qwen2-VL's multimodal RoPE


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something the native runner does not compute."""


@dataclass(frozen=True)
class DecoderSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v (not on o); Llama has none
    rope_type: str
    rope_inv_freq: torch.Tensor  # [head_dim // 2] float32 inverse frequencies
    rope_attention_scaling: float  # factor on cos/sin (yarn's attention temperature; 1 otherwise)

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def planes(self) -> int:
        """KV-cache planes per layer: one; a looped decoder keeps one per loop."""
        return 1


@dataclass(frozen=True)
class LoopedSpec(DecoderSpec):
    """A looped decoder: the `num_layers` physical layers run `depth` times; the K/V of
    (loop t, layer l) live in plane t of layer l."""

    layout: str  # "ouro": sandwich norms; "nanbeige": pre-norm (Llama) blocks
    depth: int

    @property
    def planes(self) -> int:
        return self.depth


def _unsupported(family: str, key: str, value, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{family} config: {key}={value!r} is not supported by the native runner ({why}); "
        "serve this model with the transformers backend (HFEngine)"
    )


def decoder_spec(config) -> DecoderSpec:
    """Validate a `transformers` config of a Qwen2/Llama causal LM (or a looped LM: `looped_spec`) and
    extract what the runner needs."""
    family = getattr(config, "model_type", None)
    if family == LOOPED:
        return looped_spec(config)
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"config: model_type={family!r} is not supported by the native runner "
            f"(supported: {', '.join(FAMILIES + (LOOPED,))}); "
            "serve this model with the transformers backend (HFEngine)"
        )
    if getattr(config, "quantization_config", None):
        raise _unsupported(family, "quantization_config", config.quantization_config, "quantized weights")
    _check_every_key(config, family)
    if config.hidden_act != "silu":
        raise _unsupported(family, "hidden_act", config.hidden_act, "the MLP is SwiGLU with silu")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise _unsupported(family, "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")

    if family == "qwen2":
        if config.use_sliding_window:
            raise _unsupported(family, "use_sliding_window", True, "sliding-window attention")
        qkv_bias = True
    else:
        if config.attention_bias:
            raise _unsupported(family, "attention_bias", True, "Llama attention projections without bias only")
        if config.mlp_bias:
            raise _unsupported(family, "mlp_bias", True, "MLP projections without bias only")
        qkv_bias = False
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise _unsupported(family, "layer_types", layer_types, "full causal attention in every layer only")

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inv_freq, attention_scaling, rope_type = _rope(config, family, head_dim)
    return DecoderSpec(**_shape(config, family, heads, kv_heads, head_dim), qkv_bias=qkv_bias, rope_type=rope_type,
                       rope_inv_freq=inv_freq, rope_attention_scaling=float(attention_scaling))


@lru_cache(maxsize=None)
def _class_keys(cls) -> frozenset[str]:
    """The keys a config class defines beyond every config's (names, ids to labels, output flags)."""
    return frozenset(cls().to_dict()) - frozenset(PretrainedConfig().to_dict())


def _check_every_key(config, family: str) -> None:
    """Refuse a key of the family's config class that is neither read nor inert, and a known extra key
    with a value the runner does not compute."""
    for key, value in config.to_dict().items():
        if key in EXTRA_KEYS and value not in (None, EXTRA_KEYS[key]):
            raise _unsupported(family, key, value, f"only {key}={EXTRA_KEYS[key]!r}")
        if key in _class_keys(type(config)) and key not in READ | INERT:
            raise _unsupported(family, key, value, "a config key the native runner does not read")


def _shape(config, family: str, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The DecoderSpec fields every family reads the same way from its config."""
    return dict(family=family, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
                num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
                tie_word_embeddings=bool(config.tie_word_embeddings))


def looped_spec(config) -> LoopedSpec:
    """Validate a `LoopedConfig` and extract what the looped runner needs.

    The runner shares the Qwen2/Llama attention and MLP, so biases are refused (the looped
    model's `attention_bias` also puts one on o_proj). The exit gate takes no key: at fixed
    depth the logits come from the last loop and the gate is never evaluated.
    """
    family = LOOPED
    if getattr(config, "quantization_config", None):
        raise _unsupported(family, "quantization_config", config.quantization_config, "quantized weights")
    if config.layout not in LOOPED_LAYOUTS:
        raise _unsupported(family, "layout", config.layout, f"supported: {', '.join(LOOPED_LAYOUTS)}")
    if not isinstance(config.depth, int) or config.depth < 1:
        raise _unsupported(family, "depth", config.depth, "a whole number of loops, at least one")
    if config.hidden_act != "silu":
        raise _unsupported(family, "hidden_act", config.hidden_act, "the MLP is SwiGLU with silu")
    if config.attention_bias:
        raise _unsupported(family, "attention_bias", True, "attention projections without bias only")
    if config.mlp_bias:
        raise _unsupported(family, "mlp_bias", True, "MLP projections without bias only")
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if heads % kv_heads:
        raise _unsupported(family, "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    # Plain RoPE from rope_theta, as `caspo.models.looped_layers.rope` computes it.
    inv_freq = 1.0 / (float(config.rope_theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return LoopedSpec(
        **_shape(config, family, heads, kv_heads, head_dim),
        qkv_bias=False,
        rope_type="default",
        rope_inv_freq=inv_freq,
        rope_attention_scaling=1.0,
        layout=config.layout,
        depth=config.depth,
    )


def _rope(config, family: str, head_dim: int) -> tuple[torch.Tensor, float, str]:
    """RoPE inverse frequencies and cos/sin scaling, exactly as `transformers` computes them."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise _unsupported(family, "rope_parameters", params, "RoPE parameters are required")
    if any(isinstance(v, dict) for v in params.values()):
        raise _unsupported(family, "rope_parameters", params, "one RoPE for all layers only")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _unsupported(family, "rope_parameters.rope_type", rope_type,
                           f"config.json's rope_scaling; supported: {', '.join(ROPE_TYPES)}; dynamic and longrope "
                           "rescale with the batch's length")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise _unsupported(family, "rope_parameters.partial_rotary_factor", partial, "rotary on the full head only")
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0, rope_type
    # The scaled variants come from transformers' own functions, so frequencies match the oracle
    # bit for bit. They standardize the config in place, hence the copy.
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](copy.deepcopy(config), device=torch.device("cpu"))
    return inv_freq.float(), attention_scaling, rope_type
