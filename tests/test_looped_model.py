"""The looped (fixed-depth recurrent) causal LM: cache, Llama equivalence, recompute, sizes, HF round trips."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)

import caspo.models.looped as looped
from caspo.models.looped import CACHE_FIELD, LoopedCache, LoopedConfig, LoopedForCausalLM, LoopedForValue
from caspo.models.looped_upstream import from_upstream_config, map_upstream_state_dict
from caspo.models.policy import load_policy


def tiny_config(layout: str, depth: int = 2, **kw) -> LoopedConfig:
    """Nanbeige-layout configs use GQA with non-square q/o (4 heads × 16 ≠ 32 hidden)."""
    base = dict(layout=layout, depth=depth, vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2 if layout == "nanbeige" else 4,
                head_dim=16 if layout == "nanbeige" else None, rope_theta=500.0, rms_norm_eps=1e-6)
    return LoopedConfig(**{**base, **kw})


def tiny_model(layout: str, depth: int = 2, seed: int = 0, **kw) -> LoopedForCausalLM:
    torch.manual_seed(seed)
    model = LoopedForCausalLM(tiny_config(layout, depth, **kw)).eval()
    with torch.no_grad():  # norms away from 1 so their placement matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


LAYOUTS = ["ouro", "nanbeige"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cached_decode_equals_full_forward(layout, depth):
    model = tiny_model(layout, depth)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        steps = [out.logits]
        cache = getattr(out, CACHE_FIELD)
        assert isinstance(cache, LoopedCache) and len(cache.layers) == depth * 2
        for i in range(5, 9):
            out = model(ids[:, i:i + 1], cache=cache)
            steps.append(out.logits)
    assert cache.get_seq_length() == 9
    assert all(layer.keys.shape[2] == 9 for layer in cache.layers)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_planes_are_separate_per_loop():
    """Loop t attends to loop-t keys: plane t·L + l holds different keys for different loops."""
    model = tiny_model("ouro", depth=3)
    with torch.no_grad():
        cache = getattr(model(torch.tensor([[3, 5, 7]]), use_cache=True), CACHE_FIELD)
    assert cache.plane(2, 1) == 5
    k = [cache.layers[cache.plane(t, 0)].keys for t in range(3)]
    assert not torch.allclose(k[0], k[1]) and not torch.allclose(k[1], k[2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_left_padded_batch_with_decode_matches_single_rows(layout):
    """The rollout engine's call pattern: left padding, explicit positions, a plain DynamicCache()."""
    model = tiny_model(layout)
    rows = [[4, 9, 2, 8, 1], [7, 3]]
    width = 5
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.tensor([[11], [12]])
    with torch.no_grad():
        cache = DynamicCache()
        first = model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        second = model(nxt, attention_mask=mask, position_ids=pos[:, -1:] + 1, cache=cache).logits[:, -1]
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r + [int(nxt[i])]]), use_cache=False).logits[0]
            torch.testing.assert_close(first[i], alone[-2], atol=1e-5, rtol=0)
            torch.testing.assert_close(second[i], alone[-1], atol=1e-5, rtol=0)


def test_one_loop_nanbeige_equals_llama():
    torch.manual_seed(0)
    llama_cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
                            bos_token_id=None, eos_token_id=None)
    llama = LlamaForCausalLM(llama_cfg).eval()
    with torch.no_grad():
        for name, p in llama.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    # a Llama config plus num_loops is a Nanbeige4.2-style upstream config
    cfg = from_upstream_config({**llama_cfg.to_dict(), "num_loops": 1})
    assert (cfg.layout, cfg.depth, cfg.head_dim, cfg.rope_theta) == ("nanbeige", 1, 16, 500.0)
    model = LoopedForCausalLM(cfg).eval()
    model.load_state_dict(map_upstream_state_dict(llama.state_dict(), cfg), strict=True)
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)


def grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recompute_gives_the_same_gradients(layout, monkeypatch):
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(3))
    plain = tiny_model(layout, depth=3).train()
    reference = grads(plain, ids)

    calls = []
    real = looped.checkpoint
    monkeypatch.setattr(looped, "checkpoint", lambda *a, **k: calls.append(k) or real(*a, **k))
    for switch in ("hf", "config"):
        model = tiny_model(layout, depth=3).train()
        if switch == "hf":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.config.recompute = True
        calls.clear()
        got = grads(model, ids)
        assert len(calls) == 3 * 2 and all(k == {"use_reentrant": False} for k in calls)  # every block, every loop
        assert got.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(got[name], reference[name], atol=1e-6, rtol=0, msg=name)


def test_recompute_refuses_what_it_does_not_implement():
    model = tiny_model("ouro").train()
    with pytest.raises(NotImplementedError, match="looped models checkpoint every block, non-reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="use_cache=False"):
        model(torch.tensor([[1, 2]]), use_cache=True)


def test_exit_gate_is_present_frozen_and_unused():
    model = tiny_model("ouro")
    gate = model.model.early_exit_gate
    assert gate.weight.shape == (1, 32) and not gate.weight.requires_grad and not gate.bias.requires_grad
    ids = torch.tensor([[1, 2, 3]])
    before = model(ids).logits
    with torch.no_grad():
        gate.weight.fill_(5.0)
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    assert not hasattr(tiny_model("nanbeige").model, "early_exit_gate")


def test_per_loop_hidden_states():
    model = tiny_model("ouro", depth=3)
    out = model.model(torch.tensor([[1, 2, 3]]), output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == 4  # h_0 (embeddings), h_1, h_2, h_3
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, atol=0, rtol=0)


OURO_1P4B = {  # upstream config.json keys of Ouro-1.4B
    "model_type": "ouro", "architectures": ["OuroForCausalLM"], "vocab_size": 49152, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "hidden_act": "silu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
    "total_ut_steps": 4, "early_exit_threshold": 1.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}


def meta_count(cls, cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in cls(cfg).parameters())


def test_ouro_1p4b_parameter_count():
    """Ouro-1.4B's parameters, counted from its config: untied embedding and head (V·H each); per layer the
    q, k, v, o projections (16 heads and 16 KV heads of 128 = H, no biases: 4H²), the SwiGLU MLP (3H·F) and
    four RMSNorms (the sandwich norms around attention and MLP: 4H); the final norm (H) and the exit gate,
    a Linear(H, 1) with its bias (H + 1)."""
    cfg = from_upstream_config(OURO_1P4B)
    assert (cfg.layout, cfg.depth, cfg.head_dim, cfg.num_planes) == ("ouro", 4, 128, 96)
    with torch.device("meta"):
        model = LoopedForCausalLM(cfg)
    V, H, F, L = (OURO_1P4B[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
    assert sum(p.numel() for p in model.parameters()) == 2 * V * H + L * (4 * H * H + 3 * H * F + 4 * H) + H + (H + 1)
    assert sum(p.numel() for p in model.model.early_exit_gate.parameters()) == H + 1


def test_nanbeige_4p2_parameter_counts():
    """22 layers × 2 loops, hidden 3072, 48/8 heads of 128 (q/o non-square), FFN 10752, vocab 166144,
    untied; the actor and critic sizes reported for it: 4,169,800,704 and 3,659,409,408."""
    cfg = LoopedConfig(layout="nanbeige", depth=2, vocab_size=166144, hidden_size=3072, intermediate_size=10752,
                       num_hidden_layers=22, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                       rope_theta=7e7)
    assert meta_count(LoopedForCausalLM, cfg) == 4_169_800_704
    assert meta_count(LoopedForValue, cfg) == 3_659_409_408


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_and_auto_load_round_trip(layout, tmp_path):
    model = tiny_model(layout)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LoopedForCausalLM and loaded.config.layout == layout
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(load_policy(str(tmp_path))(ids).logits, model(ids).logits, atol=0, rtol=0)
    frozen = [n for n, p in loaded.named_parameters() if not p.requires_grad]
    assert frozen == (["model.early_exit_gate.weight", "model.early_exit_gate.bias"] if layout == "ouro" else [])


def argmax_without_cache(model, ids, steps):
    for _ in range(steps):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generate_equals_argmax_loop(layout):
    model = tiny_model(layout, depth=3)
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = argmax_without_cache(model, prompt, 6)
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
        assert torch.equal(got, expected)
        # a manual decode loop with the cache under its older keyword
        ids, out = prompt, model(prompt, use_cache=True)
        for _ in range(6):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            out = model(nxt, past_key_values=getattr(out, CACHE_FIELD))
    assert torch.equal(ids, expected)


def test_cache_mismatch_and_unknown_options_raise():
    model = tiny_model("ouro", depth=2)
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="depth"):
        model(ids, cache=LoopedCache(tiny_config("ouro", depth=3)))
    with pytest.raises(TypeError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", pad_token_id=0)
    with pytest.raises(ValueError, match="layout"):
        LoopedConfig(layout="loopy")


def test_value_model_from_policy_checkpoint(tmp_path):
    """Loaded the way HF critics are: a one-label token classifier from the policy folder."""
    policy = tiny_model("ouro")
    policy.save_pretrained(tmp_path)
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path, num_labels=1)
    assert type(critic) is LoopedForValue and not hasattr(critic, "lm_head")
    assert critic.score.weight.shape == (1, 32) and critic.score.bias is None
    assert not critic.model.early_exit_gate.weight.requires_grad
    torch.testing.assert_close(critic.model.layers[1].mlp.up_proj.weight, policy.model.layers[1].mlp.up_proj.weight)
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(6))
    out = critic(ids)
    assert out.values.shape == (2, 6) and out.logits.shape == (2, 6, 1)
    hidden = critic.base_model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden, policy.model(ids, use_cache=False).last_hidden_state, atol=0, rtol=0)
    torch.testing.assert_close(out.values, critic.score(hidden).squeeze(-1), atol=0, rtol=0)
    out.values.sum().backward()
    assert critic.score.weight.grad is not None and critic.model.early_exit_gate.weight.grad is None
    with pytest.raises(ValueError, match="num_labels"):
        LoopedForValue(tiny_config("ouro", num_labels=2))
