"""Upstream Ouro and Nanbeige4.2 checkpoints → `LoopedConfig` / `LoopedForCausalLM` / `LoopedForValue`.

    model = load_upstream("/models/Ouro-1.4B")        # config.json + *.safetensors, upstream names
    convert_upstream("/models/Ouro-1.4B", "/ckpt/ouro-looped")   # model, tokenizer, source record

`load_policy` and `load_critic` convert an upstream folder on load (`upstream_config` detects it by
`model_type` "ouro" / "nanbeige", or by Ouro's `total_ut_steps` / Nanbeige's `num_loops`); upstream's
remote code is never run. Depth comes from `total_ut_steps` (Ouro) or `num_loops` (Nanbeige4.2);
parameter names map by identity. Every config key is read, checked, or ignored for a stated reason
(`IGNORED`); a setting the looped model does not implement and a key not known here both raise,
naming the key. Loading the released weights is unverified. Key table, names and status: docs/looped.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.activations import ACT2FN

from caspo.models.hub import SOURCE_RECORD, recorded_revision
from caspo.models.looped import LoopedConfig, LoopedForCausalLM, LoopedForValue
from caspo.models.tokenizer import load_tokenizer, save_tokenizer

UPSTREAM_TYPES = ("ouro", "nanbeige")
LOOP_KEYS = ("total_ut_steps", "num_loops")
# read into LoopedConfig as they are
COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "initializer_range",
               "bos_token_id", "eos_token_id", "pad_token_id")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# read and checked below: unsupported values raise
CHECKED_KEYS = {"rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor", "kv_channels",
                "use_sliding_window", "sliding_window", "layer_types", "attention_dropout", "pretraining_tp",
                "is_encoder_decoder", "add_cross_attention", "pruned_heads", "total_ut_steps",
                "early_exit_threshold", "early_exit_step", "num_loops", "skip_loop_final_norm", "loop_loss_weights"}
# Nanbeige4.2's optional remote-code features: each must be off (false, 0, null or empty)
NANBEIGE_OFF = ("qk_layernorm", "emb_neighbor_num", "insert_ngram_layer_idx", "ngram_insert_all_layers",
                "enable_double_loop_split", "loop_middle_layers", "loop_share_kv", "enable_hyper_connection",
                "enable_mhc", "enable_h_res_identity", "enable_depth_attention")
# keys without effect on the forward pass, and why
IGNORED = {
    **dict.fromkeys(("architectures", "model_type"), "the layout is read from the config keys"),
    "auto_map": "points at upstream's remote code, which is never run",
    **dict.fromkeys(("torch_dtype", "dtype"), "the storage dtype: caspo loads in the dtype it asks for"),
    **dict.fromkeys(("transformers_version", "_name_or_path", "tokenizer_class", "prefix", "finetuning_task",
                     "task_specific_params", "torchscript", "use_bfloat16", "tf_legacy_loss"), "metadata"),
    "use_cache": "a generation default; caspo's callers choose",
    "max_window_layers": "only read with sliding windows, which must be off (use_sliding_window)",
    "chunk_size_feed_forward": "computes the MLP in position chunks: the same result",
    **dict.fromkeys(("output_attentions", "output_hidden_states", "return_dict"), "output options of HF's forward"),
    **dict.fromkeys(("id2label", "label2id", "problem_type"), "classifier heads, not the LM's"),
    **dict.fromkeys(("is_decoder", "tie_encoder_decoder", "cross_attention_hidden_size", "sep_token_id",
                     "decoder_start_token_id"), "encoder-decoder fields (is_encoder_decoder is checked)"),
    **dict.fromkeys(("max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
                     "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
                     "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
                     "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
                     "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
                     "suppress_tokens", "begin_suppress_tokens"), "generation defaults: caspo samples by rollout.*"),
}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def is_upstream_looped(d: dict) -> bool:
    """An upstream looped config: model_type "ouro" / "nanbeige", or any config (a Llama one too) with a
    loop count. Loaded as a plain model, such a config would silently run its layers once."""
    return d.get("model_type") != LoopedConfig.model_type and (
        d.get("model_type") in UPSTREAM_TYPES or any(k in d for k in LOOP_KEYS))


def upstream_config(path: str | Path) -> dict | None:
    """The config.json of `path` when it is a folder holding an upstream looped checkpoint, else None."""
    if not (Path(path) / "config.json").is_file():
        return None
    d = read_config(path)
    return d if is_upstream_looped(d) else None


def upstream_layout(d: dict) -> str:
    ouro = "total_ut_steps" in d or d.get("model_type") == "ouro"
    nanbeige = "num_loops" in d
    if ouro == nanbeige:
        kind = d.get("model_type")
        raise ValueError(f"cannot tell the looped layout of this {kind!r} config: an Ouro config has total_ut_steps, "
                         "a (looped) Nanbeige4.2 config num_loops; a Nanbeige config without num_loops is not looped")
    return "ouro" if ouro else "nanbeige"


def from_upstream_config(d: dict, ignore_keys=(), **overrides) -> LoopedConfig:
    """A LoopedConfig from an upstream config.json dict; `overrides` set LoopedConfig fields (e.g. depth).
    `ignore_keys`: keys not known here that the caller has checked have no effect on the forward pass."""
    layout = upstream_layout(d)
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"upstream config lacks {missing}")
    unknown = sorted(set(d) - set(COMMON_KEYS) - CHECKED_KEYS - set(NANBEIGE_OFF) - set(IGNORED) - set(ignore_keys))
    if unknown:
        flags = " ".join(f"--ignore-key {k}" for k in unknown)
        raise ValueError(f"upstream config keys {unknown} are not known to the conversion and may configure a "
                         "feature the looped model lacks; if upstream's modeling code shows they do not change "
                         f"the forward pass, convert with `caspo convert SRC DST {flags}`")
    fields = {k: d[k] for k in COMMON_KEYS if d.get(k) is not None}
    fields["head_dim"] = head_dim(d)
    fields["rope_theta"] = rope_theta(d)
    if fields.get("hidden_act", "silu") not in ACT2FN:
        raise ValueError(f"hidden_act={fields['hidden_act']!r} is not an activation transformers knows")
    check_attention(d)
    fields["depth"] = ouro_depth(d) if layout == "ouro" else nanbeige_depth(d)
    return LoopedConfig(layout=layout, **{**fields, **overrides})


def ouro_depth(d: dict) -> int:
    if "total_ut_steps" not in d:
        raise ValueError("Ouro config lacks total_ut_steps")
    if d.get("early_exit_threshold") not in (None, 1.0):
        raise ValueError(f"early_exit_threshold={d['early_exit_threshold']} (adaptive exit by the gate) is not "
                         "implemented: only fixed-depth last-loop logits (1.0)")
    if d.get("early_exit_step") is not None:
        raise ValueError(f"early_exit_step={d['early_exit_step']} (exit at a fixed earlier loop) is not implemented; "
                         "set the depth instead (total_ut_steps)")
    return d["total_ut_steps"]


def nanbeige_depth(d: dict) -> int:
    if d.get("skip_loop_final_norm"):
        raise ValueError("skip_loop_final_norm=true is not implemented (the norm runs after every loop)")
    if d.get("loop_loss_weights"):
        raise ValueError("loop_loss_weights (per-loop losses) are not implemented")
    enabled = [k for k in NANBEIGE_OFF if d.get(k)]
    if enabled:
        raise ValueError(f"Nanbeige options not implemented: {enabled}")
    return d["num_loops"]


def head_dim(d: dict) -> int | None:
    """`head_dim`, or Nanbeige's `kv_channels` naming the same width."""
    a, b = d.get("head_dim"), d.get("kv_channels")
    if a is not None and b is not None and a != b:
        raise ValueError(f"head_dim={a} and kv_channels={b} disagree")
    return a if a is not None else b


def rope_theta(d: dict) -> float:
    """Plain RoPE only: no scaling type, no partial rotation."""
    for name in ("rope_parameters", "rope_scaling"):
        params = d.get(name) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{name} rope_type {kind!r} is not implemented; only plain RoPE")
        extra = sorted(set(params) - ROPE_KEYS)
        if extra:
            raise ValueError(f"{name} keys {extra} are not implemented; only plain RoPE")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 (partial RoPE) is not implemented")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 (partial RoPE) is not implemented")
    theta = d.get("rope_theta")
    if theta is None:
        theta = (d.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        raise ValueError("upstream config lacks rope_theta")
    return float(theta)


def check_attention(d: dict) -> None:
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window) is not implemented")
    if d.get("sliding_window") is not None and "use_sliding_window" not in d:
        raise ValueError(f"sliding_window={d['sliding_window']} without use_sliding_window=false: sliding-window "
                         "attention is not implemented")
    if any(t != "full_attention" for t in d.get("layer_types") or []):
        raise ValueError(f"only full-attention layers are implemented, got layer_types={d['layer_types']}")
    if d.get("attention_dropout"):
        raise ValueError("attention_dropout is not implemented")
    if d.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError("pretraining_tp > 1 is not implemented")
    for key in ("is_encoder_decoder", "add_cross_attention", "pruned_heads"):
        if d.get(key):
            raise ValueError(f"{key} is not implemented (a decoder-only model with every head)")


def map_upstream_state_dict(state_dict: dict[str, torch.Tensor], config: LoopedConfig,
                            cls: type = LoopedForCausalLM) -> dict[str, torch.Tensor]:
    """Upstream tensors → the state dict of a `cls` model (the LM, or the critic, whose `score` head
    starts at 0); raises on missing, unexpected or mis-shaped tensors."""
    out = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if cls is LoopedForValue:  # the LM head is not part of the critic
        out.pop("lm_head.weight", None)
        out["score.weight"] = torch.zeros(1, config.hidden_size)
    with torch.device("meta"):
        expected = cls(config).state_dict()
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


def load_upstream(path: str | Path, dtype: torch.dtype | None = torch.float32, ignore_keys=(),
                  cls: type = LoopedForCausalLM, weights: bool = True, **overrides):
    """Load an upstream Ouro / Nanbeige4.2 checkpoint folder (config.json and safetensors) as a `cls`
    (the LM, or its critic `LoopedForValue`); dtype None keeps the stored dtypes. With `weights=False`, the
    model's skeleton on the meta device: its structure, no weights read."""
    path = Path(path)
    config = from_upstream_config(read_config(path), ignore_keys, **overrides)
    with torch.device("meta"):
        model = cls(config)
    if weights:
        state = map_upstream_state_dict(read_safetensors(path), config, cls)
        model.load_state_dict({k: v if dtype is None else v.to(dtype) for k, v in state.items()}, strict=True,
                              assign=True)
    elif dtype is not None:
        model.to(dtype)
    if config.tie_word_embeddings and cls is LoopedForCausalLM:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.freeze_exit_gate()
    if cls is LoopedForCausalLM and (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))  # its EOS ids end completions
    return model


def convert_upstream(src: str | Path, dst: str | Path, ignore_keys=()) -> LoopedForCausalLM:
    """Write `dst`: the model as a caspo-looped HF folder in the stored dtype, the tokenizer, the generation
    config, and `caspo_source.json` (the source folder and the hub revision it records). `dst` must not
    exist; it appears complete or not at all."""
    src, dst = Path(src), Path(dst)
    if upstream_config(src) is None:
        raise ValueError(f"{src} is not an upstream Ouro / Nanbeige4.2 folder (no config.json with model_type "
                         "ouro or nanbeige, total_ut_steps or num_loops)")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; remove it or pick another destination")
    model = load_upstream(src, dtype=None, ignore_keys=ignore_keys)
    tokenizer = load_tokenizer(src)
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        save_tokenizer(tokenizer, partial)
        record = {"format": "caspo-upstream-looped/1", "source": str(src.resolve()), "layout": model.config.layout,
                  "revision": recorded_revision(src)}
        (partial / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        partial.rename(dst)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return model
