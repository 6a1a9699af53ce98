"""Decode attention with RoPE and the cache write in its prologue (caspo/rollout/native/rope_attention.py) against
rope_store followed by decode_attention. Without CUDA the kernels run in triton's interpreter (conftest.py)."""

import pytest
import torch
from test_rope_store import device_for_triton, rope_tables

pytest.importorskip("triton")

from caspo.rollout.native.decode_attention import decode_attention  # noqa: E402
from caspo.rollout.native.rope_attention import fuses, rope_decode_attention  # noqa: E402
from caspo.rollout.native.rope_store import rope_store  # noqa: E402


def dtype_on(device: str, dtype: torch.dtype) -> torch.dtype:
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("triton's interpreter computes bf16 dots wrongly (decode_attention too): bf16 runs on a GPU")
    return dtype


def two_kernels(qkv, cos, sin, positions, lengths, slots, key_len, cache_k, cache_v, heads):
    q = rope_store(qkv[:, None], cos, sin, positions[:, None], slots, cache_k, cache_v, heads)
    return decode_attention(q[:, 0], cache_k, cache_v, lengths, key_len, slots)


def decode_inputs(dtype, device, heads=4, kv_heads=2, head_dim=16, length=48, seed=0):
    """qkv of 3 rows at positions 7, 0 and 40 of slots 4, 0 and 2, the caches as views of one [2, S, Hkv, L, D]."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype).to(device)
    cos, sin = (t.to(device) for t in rope_tables(length, head_dim, dtype))
    positions = torch.tensor([7, 0, 40], device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    cache = torch.randn(2, 6, kv_heads, length, head_dim, generator=generator).to(dtype).to(device)
    return qkv, cos, sin, positions, positions + 1, slots, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (12, 2), (2, 2)])
def test_one_kernel_equals_rope_store_then_decode_attention(dtype, heads, kv_heads):
    """The attention and the whole cache afterwards (the new keys and values written, nothing else moved) equal
    the two kernels' bit for bit, at query groups of 2, 6 and 1."""
    device = device_for_triton()
    qkv, cos, sin, positions, lengths, slots, cache = decode_inputs(dtype_on(device, dtype), device, heads, kv_heads)
    key_len = cache.shape[3]
    assert fuses(dtype, 3, kv_heads, key_len)  # keys shorter than a split's minimum: one split
    expected_cache = cache.clone()
    expected = two_kernels(qkv, cos, sin, positions, lengths, slots, key_len, expected_cache[0], expected_cache[1],
                           heads)
    got = rope_decode_attention(qkv, cos, sin, positions, lengths, slots, key_len, cache[0], cache[1], heads)
    assert torch.equal(got, expected)
    assert torch.equal(cache, expected_cache)
    assert got.abs().sum() > 0 and got.abs().max() < 10  # attention averages values of magnitude ~1


def test_the_fused_kernel_reads_the_key_it_wrote():
    """A row at position 0 attends to its own key alone: its output is its own value, rounded to the dtype."""
    device = device_for_triton()
    heads, kv_heads, head_dim = 4, 2, 16
    qkv, cos, sin, positions, lengths, slots, cache = decode_inputs(torch.float16, device, heads, kv_heads)
    got = rope_decode_attention(qkv, cos, sin, positions, lengths, slots, cache.shape[3], cache[0], cache[1], heads)
    value = qkv[1, (heads + kv_heads) * head_dim:].reshape(kv_heads, head_dim)
    assert torch.equal(got[1], value.repeat_interleave(heads // kv_heads, dim=0))


def test_when_one_kernel_runs():
    """One program per (row, KV head) must read the row's whole key range, in bf16 or fp16; a float32 model or
    a batch that splits its keys runs the two kernels (which `rope_decode_attention` still returns)."""
    assert fuses(torch.bfloat16, 256, 2, 640)  # the rollout's decode: 512 programs, one split
    assert fuses(torch.float16, 1024, 2, 4096)
    assert not fuses(torch.float32, 256, 2, 640)
    assert not fuses(torch.bfloat16, 4, 2, 1024)  # 8 programs: the keys are split to fill the card

    device = device_for_triton()
    heads, kv_heads = 4, 2
    qkv, cos, sin, positions, lengths, slots, cache = decode_inputs(torch.float32, device, heads, kv_heads)
    expected_cache = cache.clone()
    expected = two_kernels(qkv, cos, sin, positions, lengths, slots, 48, expected_cache[0], expected_cache[1], heads)
    got = rope_decode_attention(qkv, cos, sin, positions, lengths, slots, 48, cache[0], cache[1], heads)
    assert torch.equal(got, expected) and torch.equal(cache, expected_cache)


@pytest.mark.gpu
def test_one_kernel_at_the_rollout_shape_on_the_gpu():
    """256 rows of a Qwen2.5-1.5B layer (12 / 2 heads, head_dim 128, bf16) at ragged lengths up to 640 keys, in
    a cache of 300 slots: bit for bit the two kernels', replayed from a CUDA graph too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    heads, kv_heads, head_dim, length, rows = 12, 2, 128, 640, 256
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16().cuda()
    cos, sin = (t.cuda() for t in rope_tables(length, head_dim, torch.bfloat16))
    slots = torch.randperm(300, generator=generator)[:rows].cuda()
    positions = torch.randint(0, length, (rows,), generator=generator).cuda()
    cache = torch.randn(2, 300, kv_heads, length, head_dim, generator=generator).bfloat16().cuda()
    assert fuses(torch.bfloat16, rows, kv_heads, length)
    expected_cache = cache.clone()
    expected = two_kernels(qkv, cos, sin, positions, positions + 1, slots, length, expected_cache[0],
                           expected_cache[1], heads)
    got = rope_decode_attention(qkv, cos, sin, positions, positions + 1, slots, length, cache[0], cache[1], heads)
    assert torch.equal(got, expected) and torch.equal(cache, expected_cache)

    replayed_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = rope_decode_attention(qkv, cos, sin, positions, positions + 1, slots, length, replayed_cache[0],
                                         replayed_cache[1], heads)
    replayed_cache.copy_(cache)
    graph.replay()
    assert torch.equal(replayed, expected) and torch.equal(replayed_cache, expected_cache)


def test_an_fp16_engine_samples_the_same_tokens_with_the_fused_decode():
    """An fp16 engine with both kernels on (prefill through rope_store, decode steps through the fused kernel)
    samples the tokens and log-probs of the same engine with RoPE and the writes eager."""
    from native_checks import engine, requests
    from test_native_engine import build, qwen2_untied

    from caspo.models.policy import cast_parameters
    from caspo.rollout.base import SamplingParams

    device_for_triton()
    model = cast_parameters(build(qwen2_untied()), torch.float16)
    sp = SamplingParams(temperature=1.0, stop_token_ids=[1])
    reqs = requests(5, max_new=8)
    fused = engine(model, decode_kernel=True, rope_kernel=True)
    assert fused.dtype == torch.float16 and fuses(torch.float16, 5, fused.spec.num_kv_heads, 64)
    got = fused.generate(reqs, sp)
    expected = engine(model, decode_kernel=True, rope_kernel=False).generate(reqs, sp)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    assert sum(len(c.tokens) for c in got) > 5 * 2  # decode steps ran, not only prefills


def test_the_fused_kernel_refuses_mixed_dtypes_and_a_key_range_past_the_cache():
    device = device_for_triton()
    qkv, cos, sin, positions, lengths, slots, cache = decode_inputs(torch.float16, device)
    with pytest.raises(ValueError, match="one dtype"):
        rope_decode_attention(qkv, cos.float(), sin.float(), positions, lengths, slots, 48, cache[0], cache[1], 4)
    with pytest.raises(ValueError, match="key_len must be in"):
        rope_decode_attention(qkv, cos, sin, positions, lengths, slots, 49, cache[0], cache[1], 4)
