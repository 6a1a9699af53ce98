"""Prefill attention of the native runner: whole prompts take SDPA's own causal mask (flash on a GPU), pieces past
position 0 the folded-GQA boolean mask. Both must compute the same attention."""

import pytest
import torch
from native_checks import engine
from transformers import AutoModelForCausalLM, Qwen2Config

import caspo.rollout.native.runner as runner_module
from caspo.rollout.base import Request, SamplingParams
from caspo.rollout.native.runner import Batch, causal_attention, grouped_attention


@pytest.mark.parametrize("heads,kv_heads", [(12, 2), (4, 4)])
def test_causal_attention_equals_the_masked_attention_of_positions_from_zero(heads, kv_heads):
    """Rows at positions 0..T-1 over keys [0, T): the same output as grouped_attention under Batch.build's mask,
    at query groups of 6 and 1 (float32, SDPA's math kernel on the CPU)."""
    generator = torch.Generator().manual_seed(0)
    B, T, D = 3, 9, 16
    q = torch.randn(B, T, heads, D, generator=generator)
    k, v = (torch.randn(B, kv_heads, T, D, generator=generator) for _ in range(2))
    positions = torch.arange(T).expand(B, T)
    masked = Batch.build(torch.arange(B), positions, T, heads // kv_heads)
    from_zero = Batch.build(torch.arange(B), positions, T, heads // kv_heads, from_zero=True)
    assert from_zero.causal and from_zero.mask is None and not masked.causal
    got = causal_attention(q, k, v)
    assert got.shape == (B, T, heads * D)
    torch.testing.assert_close(got, grouped_attention(q, k, v, masked.mask), rtol=0, atol=1e-6)
    # not the same function twice: the first query sees only key 0, so its output is value 0 of its KV head
    first = got[:, 0].view(B, kv_heads, heads // kv_heads, D)
    torch.testing.assert_close(first, v[:, :, :1].expand_as(first), rtol=0, atol=1e-6)


def test_from_zero_needs_as_many_keys_as_queries():
    with pytest.raises(ValueError, match="key_len = T = 4"):
        Batch.build(torch.arange(2), torch.arange(4).expand(2, 4), 6, 2, from_zero=True)


def test_whole_prompts_take_the_causal_path_and_pieces_past_zero_the_mask(monkeypatch):
    """Counts the two paths' calls: a fresh prefill of whole prompts is causal alone; a prompt prefilled in pieces
    computes its later pieces under the mask; teacher-forced logits are causal. Tokens are the same either way."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)).eval()
    calls = {"causal": 0, "masked": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(runner_module, "causal_attention", counted("causal", causal_attention))
    monkeypatch.setattr(runner_module, "grouped_attention", counted("masked", grouped_attention))
    sp = SamplingParams(temperature=1.0)
    reqs = [Request(list(range(3, 3 + n)), seed=n, max_new_tokens=1) for n in (5, 23)]  # one token: prefill only

    whole = engine(model, prefix_sharing=False).generate(reqs, sp)
    assert calls == {"causal": 2, "masked": 0}  # one forward of both prompts, two layers

    calls.update(causal=0, masked=0)
    chunked = engine(model, max_prefill_tokens=16, prefix_sharing=False).generate(reqs, sp)
    assert calls["causal"] > 0 and calls["masked"] > 0  # the first pieces from 0, the 23-token prompt's rest not
    assert [c.tokens for c in chunked] == [c.tokens for c in whole]

    calls.update(causal=0, masked=0)
    engine(model).teacher_forced_logits([[3, 4, 5], [6, 7]])
    assert calls == {"causal": 2, "masked": 0}
