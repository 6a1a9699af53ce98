"""Upstream checkpoints: small fixtures written under Ouro's and Nanbeige4.2's names and config keys."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from caspo.models.looped import LoopedForCausalLM
from caspo.models.looped_upstream import (
    from_upstream_config,
    is_upstream_looped,
    load_upstream,
    map_upstream_state_dict,
)

V, HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM, THETA, EPS = 53, 32, 40, 2, 4, 8, 1000.0, 1e-6


def ouro_config(**kw) -> dict:
    return {"model_type": "ouro", "architectures": ["OuroForCausalLM"],
            "auto_map": {"AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
            "vocab_size": V, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "hidden_act": "silu",
            "max_position_embeddings": 128, "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": None,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": LAYERS, "layer_types": ["full_attention"] * LAYERS, "attention_dropout": 0.0,
            "total_ut_steps": 3, "early_exit_threshold": 1.0, "bos_token_id": 0, "eos_token_id": 0,
            "pad_token_id": 0, "torch_dtype": "bfloat16", "transformers_version": "4.54.1", **kw}


def ouro_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the names of Ouro's HF remote code (norms away from 1)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=0.2: scale * torch.randn(*shape, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": rand(V, HIDDEN, scale=1.0), "model.norm.weight": 1 + rand(HIDDEN),
         "model.early_exit_gate.weight": rand(1, HIDDEN), "model.early_exit_gate.bias": rand(1),
         "lm_head.weight": rand(V, HIDDEN), "model.rotary_emb.inv_freq": torch.ones(HEAD_DIM // 2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in "qkvo":
            t[p + f"self_attn.{proj}_proj.weight"] = rand(HIDDEN, HIDDEN)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN), rand(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            t[p + norm + ".weight"] = 1 + rand(HIDDEN)
    return t


def ouro_reference_logits(t: dict[str, torch.Tensor], ids: torch.Tensor, loops: int) -> torch.Tensor:
    """Ouro's forward written out from the equations, straight on the upstream-named tensors."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    B, T = ids.shape
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(x):
        x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def heads(x, proj):
        return (x @ t[proj + ".weight"].T).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)

    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    h = t["model.embed_tokens.weight"][ids]
    for _ in range(loops):
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            x = rms(h, t[p + "input_layernorm.weight"])
            q, k = rot(heads(x, p + "self_attn.q_proj")), rot(heads(x, p + "self_attn.k_proj"))
            v = heads(x, p + "self_attn.v_proj")
            att = (q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5).masked_fill(future, float("-inf")).softmax(-1)
            a = (att @ v).transpose(1, 2).reshape(B, T, HIDDEN) @ t[p + "self_attn.o_proj.weight"].T
            h = h + rms(a, t[p + "input_layernorm_2.weight"])
            x = rms(h, t[p + "post_attention_layernorm.weight"])
            m = F.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (x @ t[p + "mlp.up_proj.weight"].T)
            m = m @ t[p + "mlp.down_proj.weight"].T
            h = h + rms(m, t[p + "post_attention_layernorm_2.weight"])
        h = rms(h, t["model.norm.weight"])  # after every loop, replacing the stream
    return h @ t["lm_head.weight"].T


def write_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_ouro_fixture_loads_and_matches_the_equations(tmp_path):
    tensors = ouro_tensors()
    write_checkpoint(tmp_path / "ouro", ouro_config(), tensors)
    model = load_upstream(tmp_path / "ouro").eval()
    assert (model.config.layout, model.config.depth) == ("ouro", 3)
    assert not model.model.early_exit_gate.weight.requires_grad
    torch.testing.assert_close(model.model.layers[1].input_layernorm_2.weight,
                               tensors["model.layers.1.input_layernorm_2.weight"], atol=0, rtol=0)
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ouro_reference_logits(tensors, ids, loops=3), atol=1e-5, rtol=0)


def test_converted_checkpoint_loads_through_auto(tmp_path):
    tensors = ouro_tensors(seed=3)
    write_checkpoint(tmp_path / "up", ouro_config(total_ut_steps=2), tensors, shards=3)
    model = load_upstream(tmp_path / "up", depth=4)  # depth override, like hf_overrides={"total_ut_steps": 4}
    assert model.config.depth == 4
    model.save_pretrained(tmp_path / "ours")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.tensor([[5, 1, 9, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ouro_reference_logits(tensors, ids, loops=4), atol=1e-5, rtol=0)


def nanbeige_config(**kw) -> dict:
    return {"architectures": ["NanbeigeForCausalLM"], "vocab_size": V, "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": EPS,
            "rope_theta": 7e7, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "num_loops": 2, "skip_loop_final_norm": False, "loop_share_kv": False, "enable_depth_attention": False,
            "enable_hyper_connection": False, "loop_loss_weights": None, **kw}


def test_nanbeige_fixture_loads(tmp_path):
    cfg = from_upstream_config(nanbeige_config())
    assert (cfg.layout, cfg.depth, cfg.head_dim, cfg.num_key_value_heads) == ("nanbeige", 2, 16, 2)
    torch.manual_seed(0)
    source = LoopedForCausalLM(cfg).eval()
    tensors = {k: v.clone() for k, v in source.state_dict().items()}
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, HIDDEN)  # non-square q
    write_checkpoint(tmp_path, nanbeige_config(), tensors, shards=2)
    model = load_upstream(tmp_path).eval()
    ids = torch.tensor([[3, 8, 1, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("bad, named", [
    ({"early_exit_threshold": 0.9}, "early_exit_threshold"),
    ({"early_exit_step": 2}, "early_exit_step"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "default", "factor": 4.0}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"hidden_act": "swishy"}, "hidden_act"),
    ({"is_encoder_decoder": True}, "is_encoder_decoder"),
    ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
])
def test_unsupported_ouro_settings_raise_naming_them(bad, named):
    with pytest.raises(ValueError, match=named):
        from_upstream_config(ouro_config(**bad))


@pytest.mark.parametrize("bad, named", [
    ({"skip_loop_final_norm": True}, "skip_loop_final_norm"), ({"loop_share_kv": True}, "loop_share_kv"),
    ({"loop_loss_weights": [0.5, 1]}, "loop_loss_weights"), ({"emb_neighbor_num": 2}, "emb_neighbor_num"),
    ({"insert_ngram_layer_idx": [3]}, "insert_ngram_layer_idx"), ({"qk_layernorm": True}, "qk_layernorm"),
    ({"sliding_window": 4096}, "sliding_window"), ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"head_dim": 16, "kv_channels": 8}, "kv_channels"),
])
def test_unsupported_nanbeige_settings_raise_naming_them(bad, named):
    with pytest.raises(ValueError, match=named):
        from_upstream_config(nanbeige_config(**bad))


def test_off_options_and_inert_keys_pass():
    """Features switched off, Ouro's inert sliding-window fields and HF's generic fields load."""
    off = {"qk_layernorm": False, "emb_neighbor_num": 0, "insert_ngram_layer_idx": [], "enable_mhc": False,
           "max_length": 4096, "torchscript": False}
    assert from_upstream_config(nanbeige_config(**off)).depth == 2
    cfg = from_upstream_config(ouro_config(sliding_window=4096, max_window_layers=28, use_cache=False,
                                           early_exit_step=None, chunk_size_feed_forward=0))
    assert (cfg.depth, cfg.rope_theta, cfg.head_dim) == (3, THETA, HEAD_DIM)
    # Nanbeige's kv_channels names head_dim; v5 configs carry rope_theta inside rope_parameters
    cfg = from_upstream_config({**nanbeige_config(), "head_dim": None, "kv_channels": 16, "rope_theta": None,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 7e7}})
    assert (cfg.head_dim, cfg.rope_theta) == (16, 7e7)


def test_layout_must_be_recognisable_and_unknown_keys_raise():
    with pytest.raises(ValueError, match="layout"):
        from_upstream_config({k: v for k, v in nanbeige_config().items() if k != "num_loops"})
    with pytest.raises(ValueError, match=r"\['some_new_flag'\].*--ignore-key some_new_flag"):
        from_upstream_config(ouro_config(some_new_flag=True))
    assert from_upstream_config(ouro_config(some_new_flag=True), ignore_keys=["some_new_flag"]).depth == 3


def test_upstream_configs_are_told_from_plain_and_caspo_ones():
    assert is_upstream_looped(ouro_config()) and is_upstream_looped(nanbeige_config())
    assert is_upstream_looped({"model_type": "llama", "num_loops": 2})  # would run its layers once as Llama
    assert is_upstream_looped({"model_type": "nanbeige"})  # and then fails on the layout, naming it
    assert not is_upstream_looped({"model_type": "qwen2", "num_hidden_layers": 2})
    assert not is_upstream_looped({"model_type": "caspo_looped", "depth": 4})


def test_state_dict_mapping_checks_names_and_shapes():
    cfg = from_upstream_config(ouro_config())
    tensors = ouro_tensors()
    mapped = map_upstream_state_dict(tensors, cfg)
    assert "model.rotary_emb.inv_freq" not in mapped and len(mapped) == len(tensors) - 1
    with pytest.raises(ValueError, match="missing"):
        map_upstream_state_dict({k: v for k, v in tensors.items() if "input_layernorm_2" not in k}, cfg)
    with pytest.raises(ValueError, match="shapes"):
        map_upstream_state_dict({**tensors, "lm_head.weight": torch.zeros(V + 1, HIDDEN)}, cfg)
    nanbeige = from_upstream_config(nanbeige_config())
    with pytest.raises(ValueError, match="unexpected"):  # Ouro's sandwich norms and gate have no place in it
        map_upstream_state_dict(tensors, nanbeige)
