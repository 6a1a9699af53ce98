"""RoPE with the KV-cache write in one Triton kernel (caspo/rollout/native/rope_store.py) against the eager path.

Without CUDA the kernel runs in triton's interpreter (conftest.py sets TRITON_INTERPRET=1).
"""

import os

import pytest
import torch
from native_checks import requests, with_and_without
from test_native_engine import build, llama_tied, qwen2_untied

from caspo.rollout.base import SamplingParams
from caspo.rollout.native.runner import rotary_split


def device_for_triton() -> str:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton kernels need a GPU or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def rope_tables(length: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(length).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_row", [1, 5])  # a decode step; a prefill chunk
@pytest.mark.parametrize("heads", [4, 6])  # 4 + 2 · 2 heads fill the kernel's tile of 8 rows; 6 + 2 · 2 pad it to 16
def test_rope_store_writes_the_eager_numbers(dtype, tokens_per_row, heads):
    """q, and the cache after the write, equal eager RoPE and the two indexed writes bit for bit; nothing else in
    the cache moves."""
    from caspo.rollout.native.rope_store import rope_store

    device = device_for_triton()
    kv_heads, head_dim, slots, length = 2, 16, 6, 40
    generator = torch.Generator().manual_seed(tokens_per_row)
    qkv = torch.randn(3, tokens_per_row, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    cos, sin = rope_tables(length, head_dim, dtype)
    row_slots = torch.tensor([4, 0, 2])
    positions = torch.tensor([[7], [0], [33]]) + torch.arange(tokens_per_row)
    cache = torch.randn(2, slots, kv_heads, length, head_dim, generator=generator).to(dtype)

    expected_cache = cache.clone()
    q, k, v = rotary_split(qkv, cos[positions][:, :, None], sin[positions][:, :, None],
                           (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), head_dim)
    expected_cache[0][row_slots[:, None], :, positions] = k
    expected_cache[1][row_slots[:, None], :, positions] = v

    got_cache = cache.clone().to(device)
    got_q = rope_store(qkv.to(device), cos.to(device), sin.to(device), positions.to(device), row_slots.to(device),
                       got_cache[0], got_cache[1], heads)
    assert torch.equal(got_q.cpu(), q)
    assert torch.equal(got_cache.cpu(), expected_cache)
    assert not torch.equal(expected_cache, cache)  # the write happened


def test_rope_store_refuses_a_projection_of_another_width():
    from caspo.rollout.native.rope_store import rope_store

    device = device_for_triton()
    cache = torch.zeros(2, 3, 2, 8, 16, device=device)
    cos = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="does not fit 4 query heads"):
        rope_store(torch.zeros(1, 1, 100, device=device), cos, cos, torch.zeros(1, 1, dtype=torch.long, device=device),
                   torch.zeros(1, dtype=torch.long, device=device), cache[0], cache[1], 4)


def looped_depth2(layout):
    from test_native_looped import looped

    return looped(layout, 2)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: build(qwen2_untied()), id="qwen2_untied"),
    pytest.param(lambda: build(llama_tied()), id="llama_tied"),
    pytest.param(lambda: looped_depth2("ouro"), id="looped_ouro_depth2"),
    pytest.param(lambda: looped_depth2("nanbeige"), id="looped_nanbeige_depth2", marks=pytest.mark.slow)])
def test_engine_with_the_rope_kernel_samples_the_same_tokens(make):
    """The engine with rope_kernel=True (prefill and decode) samples the eager path's tokens and log-probs; a looped
    model writes each loop's plane of the cache through the kernel."""
    device_for_triton()
    model = make()
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    reqs = requests(5, max_new=8)
    got, expected = with_and_without(model, "rope_kernel", reqs, sp)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, tokens_per_row", [(256, 1), (16, 128)])  # decode rows; a prefill of whole prompts
def test_rope_store_on_the_device_at_the_qwen_shape(rows, tokens_per_row):
    """On CUDA, in bf16, at Qwen2.5-1.5B's heads (12 query, 2 KV, head_dim 128): the kernel's q and cache equal eager
    RoPE and the indexed writes, run on the device, bit for bit."""
    from caspo.rollout.native.rope_store import rope_store

    assert torch.cuda.is_available()
    heads, kv_heads, head_dim, length = 12, 2, 128, 1024
    generator = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(rows, tokens_per_row, (heads + 2 * kv_heads) * head_dim, device="cuda",
                      generator=generator).bfloat16()
    cos, sin = (t.cuda() for t in rope_tables(length, head_dim, torch.bfloat16))
    slots = torch.randperm(rows, device="cuda", generator=generator)
    positions = torch.randint(0, length - tokens_per_row, (rows, 1), device="cuda", generator=generator) + \
        torch.arange(tokens_per_row, device="cuda")
    cache = torch.zeros(2, rows, kv_heads, length, head_dim, device="cuda", dtype=torch.bfloat16)
    expected = cache.clone()
    q, k, v = rotary_split(qkv, cos[positions][:, :, None], sin[positions][:, :, None],
                           (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), head_dim)
    expected[0][slots[:, None], :, positions] = k
    expected[1][slots[:, None], :, positions] = v
    assert torch.equal(rope_store(qkv, cos, sin, positions, slots, cache[0], cache[1], heads), q)
    assert torch.equal(cache, expected)
