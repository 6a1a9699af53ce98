"""Upstream Ouro and Nanbeige4.2 checkpoints → `LoopedConfig` / `LoopedForCausalLM`.

    model = load_upstream("/models/Ouro-1.4B")      # config.json + *.safetensors, upstream names
    model.save_pretrained("/ckpt/ouro-looped")        # then loads with AutoModelForCausalLM

Depth comes from `total_ut_steps` (Ouro) or `num_loops` (Nanbeige4.2); parameter names map by
identity. Unsupported settings raise; unknown keys warn and are ignored. Loading the released
weights is unverified. Key table, names and status: docs/looped.md.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from caspo.models.looped import LoopedConfig, LoopedForCausalLM

COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "initializer_range",
               "bos_token_id", "eos_token_id", "pad_token_id")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# read and checked below, or metadata without effect on the computation
HANDLED_KEYS = {"rope_theta", "rope_parameters", "rope_scaling", "use_sliding_window", "sliding_window",
                "max_window_layers", "layer_types", "attention_dropout", "pretraining_tp", "total_ut_steps",
                "early_exit_threshold", "early_exit_step", "num_loops", "skip_loop_final_norm", "loop_loss_weights",
                "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
                "use_cache", "_name_or_path"} | set(PreTrainedConfig().to_dict())  # generic HF config fields
NANBEIGE_OFF = ("qk_layernorm", "emb_neighbor_num", "insert_ngram_layer_idx", "ngram_insert_all_layers",
                "enable_double_loop_split", "loop_middle_layers", "loop_share_kv", "enable_hyper_connection",
                "enable_mhc", "enable_h_res_identity", "enable_depth_attention")


def upstream_layout(d: dict) -> str:
    ouro = "total_ut_steps" in d or d.get("model_type") == "ouro"
    nanbeige = "num_loops" in d
    if ouro == nanbeige:
        raise ValueError("cannot tell the layout: an Ouro config has total_ut_steps, a Nanbeige4.2 config num_loops")
    return "ouro" if ouro else "nanbeige"


def from_upstream_config(d: dict, **overrides) -> LoopedConfig:
    """A LoopedConfig from an upstream config.json dict; `overrides` set LoopedConfig fields (e.g. depth)."""
    layout = upstream_layout(d)
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"upstream config lacks {missing}")
    fields = {k: d[k] for k in COMMON_KEYS if d.get(k) is not None}
    fields["rope_theta"] = rope_theta(d)
    check_attention(d)

    if layout == "ouro":
        if "total_ut_steps" not in d:
            raise ValueError("Ouro config lacks total_ut_steps")
        fields["depth"] = d["total_ut_steps"]
        if d.get("early_exit_threshold") not in (None, 1.0) or d.get("early_exit_step") is not None:
            raise ValueError("only fixed-depth last-loop logits are implemented: early_exit_threshold must be 1.0 "
                             "and early_exit_step unset")
    else:
        fields["depth"] = d["num_loops"]
        if d.get("skip_loop_final_norm"):
            raise ValueError("skip_loop_final_norm=true is not implemented (the norm runs after every loop)")
        if d.get("loop_loss_weights"):
            raise ValueError("loop_loss_weights (per-loop losses) are not implemented")
        enabled = [k for k in NANBEIGE_OFF if d.get(k)]
        if enabled:
            raise ValueError(f"Nanbeige options not implemented: {enabled}")

    ignored = sorted(set(d) - set(COMMON_KEYS) - HANDLED_KEYS - set(NANBEIGE_OFF))
    if ignored:
        warnings.warn(f"upstream config keys ignored: {ignored}", stacklevel=2)
    return LoopedConfig(layout=layout, **{**fields, **overrides})


def rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not implemented; only plain RoPE")
    theta = d.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("upstream config lacks rope_theta")
    return float(theta)


def check_attention(d: dict) -> None:
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not implemented")
    if any(t != "full_attention" for t in d.get("layer_types") or []):
        raise ValueError(f"only full-attention layers are implemented, got layer_types={d['layer_types']}")
    if d.get("attention_dropout"):
        raise ValueError("attention dropout is not implemented")
    if d.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError("pretraining_tp > 1 is not implemented")


def map_upstream_state_dict(state_dict: dict[str, torch.Tensor], config: LoopedConfig) -> dict[str, torch.Tensor]:
    """Upstream tensors → this model's state dict; raises on missing, unexpected or mis-shaped tensors."""
    out = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    with torch.device("meta"):
        expected = LoopedForCausalLM(config).state_dict()
    missing, unexpected = sorted(expected.keys() - out.keys()), sorted(out.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"upstream tensors do not match a {config.layout} model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    wrong = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in out.items()
             if v.shape != expected[k].shape]
    if wrong:
        raise ValueError(f"upstream tensor shapes differ from the config: {wrong[:8]}")
    return out


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return tensors


def load_upstream(path: str | Path, dtype: torch.dtype = torch.float32, **overrides) -> LoopedForCausalLM:
    """Load an upstream Ouro / Nanbeige4.2 checkpoint folder (config.json and safetensors)."""
    path = Path(path)
    config = from_upstream_config(json.loads((path / "config.json").read_text()), **overrides)
    state = map_upstream_state_dict(read_safetensors(path), config)
    with torch.device("meta"):
        model = LoopedForCausalLM(config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.freeze_exit_gate()
    return model
