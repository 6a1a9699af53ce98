"""The split-K decode attention kernel against a float64 reference; on CPU through Triton's interpreter.

Without CUDA, conftest.py sets TRITON_INTERPRET=1 before anything imports triton (Triton reads it
when @triton.jit wraps a kernel), so the kernels run in the interpreter. GPU tests (bf16 at the
Qwen2.5-1.5B decode shape against SDPA, CUDA-graph replay) are marked `gpu`.
"""

import pytest
import torch

pytest.importorskip("triton")

from caspo.rollout.native import decode_attention as decode_mod  # noqa: E402

decode_attention = decode_mod.decode_attention
split_plan = decode_mod.split_plan
DEVICE = "cuda" if torch.cuda.is_available() and not decode_mod.INTERPRETED else "cpu"


def reference(q, k_cache, v_cache, lengths, key_len, scale=None):
    """repeat_kv + masked softmax in float64: query head h reads KV head h // (H // Hkv)."""
    B, H, D = q.shape
    groups = H // k_cache.shape[1]
    k = k_cache[:B, :, :key_len].double().repeat_interleave(groups, dim=1)
    v = v_cache[:B, :, :key_len].double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhd,bhnd->bhn", q.double(), k) * (D ** -0.5 if scale is None else scale)
    visible = torch.arange(key_len, device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhn,bhnd->bhd", scores.softmax(-1), v)


def cache_views(B, Hkv, L, D, dtype=torch.float32, seed=0):
    """k, v as the engine passes them: kv[plane, layer, 0/1] of [planes, layers, 2, slots, Hkv, L, D], slots > B."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 3, 2, B + 2, Hkv, L, D, generator=g).to(dtype).to(DEVICE)
    return kv[1, 2, 0], kv[1, 2, 1]


def ragged_lengths(B, key_len, seed=0):
    """Random in [1, key_len], with the first row at key_len and (B > 1) the last at 1."""
    lengths = torch.randint(1, key_len + 1, (B,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = key_len
    if B > 1:
        lengths[-1] = 1
    return lengths.to(DEVICE)


def random_q(B, H, D, dtype=torch.float32, seed=1):
    """A strided q: heads 2·D apart, as a view into a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, 2 * D, generator=g).to(dtype).to(DEVICE)[..., :D]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels are compiled")
def test_interpreted_without_cuda():
    assert decode_mod.INTERPRETED, ("caspo.rollout.native.decode_attention was imported before TRITON_INTERPRET=1 "
                                    "was set: its kernels are compiled-mode and cannot run on this CPU-only machine")
    assert type(decode_mod._split_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("H,Hkv", [(12, 2), (4, 4), (7, 1), (8, 2)])
@pytest.mark.parametrize("B", [1, 3, 5])
def test_matches_reference(B, H, Hkv, D):
    L, key_len = 120, 100  # key_len: two blocks of 64, the second partial; L > key_len is never read
    k, v = cache_views(B, Hkv, L, D)
    q, lengths = random_q(B, H, D), ragged_lengths(B, key_len, seed=B)
    want = reference(q, k, v, lengths, key_len)
    # The automatic choice is one split at this length; 2 forced splits go through the combine stage.
    for num_splits in (None, 2):
        out = decode_attention(q, k, v, lengths, key_len, num_splits=num_splits)
        assert out.shape == (B, H, D) and out.dtype == torch.float32
        assert (out.double() - want).abs().max().item() <= 1e-5, num_splits


def test_never_reads_past_key_len():
    """NaN keys/values beyond key_len (and lengths larger than key_len, clamped) change nothing."""
    B, H, Hkv, D, L, key_len = 2, 6, 1, 16, 40, 21
    k, v = cache_views(B, Hkv, L, D)
    k[:, :, key_len:] = float("nan")
    v[:, :, key_len:] = float("nan")
    q = random_q(B, H, D)
    lengths = torch.tensor([key_len, 5], device=DEVICE)
    want = reference(q, k, v, lengths, key_len)
    for num_splits in (1, 4):
        out = decode_attention(q, k, v, lengths, key_len, num_splits=num_splits)
        assert (out.double() - want).abs().max().item() <= 1e-5
        over = decode_attention(q, k, v, torch.tensor([L, 5], device=DEVICE), key_len, num_splits=num_splits)
        assert torch.equal(over, out)


def test_equal_keys_average_the_visible_values():
    B, H, Hkv, D, key_len = 2, 6, 2, 16, 10
    k = torch.ones(B, Hkv, key_len, D, device=DEVICE)
    v = torch.arange(key_len, dtype=torch.float32, device=DEVICE)[None, None, :, None].expand(B, Hkv, key_len, D)
    v = v.contiguous()
    q = random_q(B, H, D)
    for num_splits in (1, 3):
        out = decode_attention(q, k, v, torch.tensor([4, 10], device=DEVICE), key_len, num_splits=num_splits)
        assert torch.allclose(out[0], torch.full_like(out[0], 1.5), atol=1e-6)  # mean of 0, 1, 2, 3
        assert torch.allclose(out[1], torch.full_like(out[1], 4.5), atol=1e-6)  # mean of 0 .. 9


def test_single_visible_key_returns_its_value():
    B, H, Hkv, D, L, key_len = 3, 4, 2, 16, 24, 24
    k, v = cache_views(B, Hkv, L, D)
    q = random_q(B, H, D)
    lengths = torch.ones(B, dtype=torch.long, device=DEVICE)
    for num_splits in (1, 5):
        out = decode_attention(q, k, v, lengths, key_len, num_splits=num_splits)
        want = v[:B, :, 0].repeat_interleave(H // Hkv, dim=1)  # head h reads KV head h // 2
        assert torch.allclose(out, want, atol=1e-6)


def test_two_keys_by_hand():
    """scale 1, q = e0, k0 = 0, k1 = ln(3)·e0: weights 1/4 and 3/4 on v0 = 0, v1 = 4, so the output is 3."""
    D = 16
    q = torch.zeros(1, 1, D, device=DEVICE)
    q[0, 0, 0] = 1.0
    k = torch.zeros(1, 1, 4, D, device=DEVICE)
    k[0, 0, 1, 0] = torch.log(torch.tensor(3.0))
    k[0, 0, 2:] = 100.0  # beyond the length: must not count
    v = torch.zeros(1, 1, 4, D, device=DEVICE)
    v[0, 0, 1] = 4.0
    v[0, 0, 2:] = -1e4
    for num_splits in (1, 2):
        out = decode_attention(q, k, v, torch.tensor([2], device=DEVICE), 4, scale=1.0, num_splits=num_splits)
        assert torch.allclose(out, torch.full_like(out, 3.0), atol=1e-6)


def test_split_counts_agree():
    B, H, Hkv, D, L, key_len = 2, 12, 2, 16, 80, 77
    k, v = cache_views(B, Hkv, L, D, seed=3)
    q, lengths = random_q(B, H, D, seed=4), torch.tensor([77, 40], device=DEVICE)
    one = decode_attention(q, k, v, lengths, key_len, num_splits=1)
    for num_splits in (2, 3, 7):
        assert (decode_attention(q, k, v, lengths, key_len, num_splits=num_splits) - one).abs().max().item() <= 1e-6


def test_empty_splits_contribute_nothing():
    """Lengths far below key_len with many splits: most chunks hold no visible key."""
    B, H, Hkv, D, L, key_len = 2, 6, 1, 16, 40, 40
    k, v = cache_views(B, Hkv, L, D, seed=5)
    q, lengths = random_q(B, H, D, seed=6), torch.tensor([1, 3], device=DEVICE)
    out = decode_attention(q, k, v, lengths, key_len, num_splits=10)
    assert not out.isnan().any()
    assert (out.double() - reference(q, k, v, lengths, key_len)).abs().max().item() <= 1e-5


def test_half_precision():
    B, H, Hkv, D, L, key_len = 2, 6, 1, 32, 50, 50
    k, v = cache_views(B, Hkv, L, D, dtype=torch.float16, seed=7)
    q, lengths = random_q(B, H, D, dtype=torch.float16, seed=8), torch.tensor([50, 20], device=DEVICE)
    out = decode_attention(q, k, v, lengths, key_len, num_splits=2)
    assert out.dtype == torch.float16
    assert (out.double() - reference(q, k, v, lengths, key_len)).abs().max().item() <= 5e-3


def test_rows_read_the_slots_they_are_given():
    # 3 rows over a cache of 5 slots: row 0 reads slot 4, row 1 slot 0, row 2 slot 4 again
    B, H, Hkv, D, L, key_len = 3, 6, 2, 16, 40, 40
    k, v = cache_views(3, Hkv, L, D, seed=9)  # 5 slots
    q, lengths = random_q(B, H, D, seed=10), torch.tensor([40, 7, 13], device=DEVICE)
    slots = torch.tensor([4, 0, 4], device=DEVICE)
    want = reference(q, k[slots], v[slots], lengths, key_len)
    for num_splits in (1, 3):
        out = decode_attention(q, k, v, lengths, key_len, slots=slots, num_splits=num_splits)
        assert (out.double() - want).abs().max().item() <= 1e-5
    default = decode_attention(q, k, v, lengths, key_len)  # slot i
    assert (default.double() - reference(q, k, v, lengths, key_len)).abs().max().item() <= 1e-5


def test_split_plan():
    assert split_plan(256, 2, 128) == (1, 128)  # 512 programs already
    assert split_plan(256, 2, 640) == (1, 640)
    assert split_plan(64, 2, 640) == (3, 256)  # 128 programs: three chunks of four 64-key blocks
    assert split_plan(1, 2, 4096) == (32, 128)  # small batch, long keys: MIN_CHUNK-key chunks
    assert split_plan(1, 1, 100) == (1, 128)  # shorter than a chunk
    assert split_plan(1, 1, 10, num_splits=6) == (5, 2)
    for batch in (1, 7, 64, 256):
        for key_len in (1, 63, 64, 65, 300, 1000, 8192):
            for forced in (None, 1, min(3, key_len)):
                splits, chunk = split_plan(batch, 2, key_len, forced)
                assert 1 <= splits <= decode_mod.MAX_SPLITS
                assert (splits - 1) * chunk < key_len <= splits * chunk  # every chunk starts before key_len
                assert forced is not None or chunk % decode_mod.BLOCK_N == 0
    with pytest.raises(ValueError, match="num_splits"):
        split_plan(1, 1, 10, num_splits=11)


def test_rejects_bad_inputs():
    k, v = cache_views(1, 2, 8, 16)
    q = random_q(1, 4, 16)
    lengths = torch.tensor([8], device=DEVICE)
    with pytest.raises(ValueError, match="last"):
        decode_attention(random_q(1, 4, 32)[..., ::2], k, v, lengths, 8)  # head_dim with stride 2
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(random_q(1, 3, 16), k, v, lengths, 8)
    with pytest.raises(ValueError, match="key_len"):
        decode_attention(q, k, v, lengths, 9)
    with pytest.raises(ValueError, match="slots"):
        decode_attention(q, k, v, lengths, 8, slots=torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="pass slots="):
        decode_attention(random_q(4, 4, 16), k, v, torch.tensor([8] * 4, device=DEVICE), 8)  # 4 rows, 3 slots


# ------------------------------------------------------------ GPU: the real decode shape, bf16

def _sdpa_decode(q, k, v, lengths, key_len):
    """The engine's current decode path: runner.grouped_attention with the folded-GQA boolean mask."""
    from caspo.rollout.native.runner import Batch, grouped_attention

    B, H, D = q.shape
    batch = Batch.build(torch.arange(B, device=q.device), (lengths - 1)[:, None], key_len, H // k.shape[1],
                        rows_are_slots=True)
    return grouped_attention(q[:, None], batch.read(k), batch.read(v), batch.mask).view(B, H, D)


def _real_shape(key_len, seed=0):
    B, H, Hkv, D, L = 256, 12, 2, 128, 640
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(1, 2, 2, B + 8, Hkv, L, D, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(B, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    lengths = torch.randint(1, key_len + 1, (B,), device="cuda", generator=g)
    lengths[0], lengths[1] = key_len, 1
    return q, kv[0, 1, 0], kv[0, 1, 1], lengths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("key_len", [384, 640])
def test_gpu_bf16_matches_sdpa(key_len):
    q, k, v, lengths = _real_shape(key_len)
    out = decode_attention(q, k, v, lengths, key_len)
    want = _sdpa_decode(q, k, v, lengths, key_len)
    diff = (out.float() - want.float()).abs()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert diff.mean().item() <= 2e-3 and diff.max().item() <= 2e-2, (diff.mean().item(), diff.max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay():
    key_len = 384
    q, k, v, lengths = _real_shape(key_len, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels outside the capture
        decode_attention(q, k, v, lengths, key_len)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, lengths, key_len)
    new_q, _, _, new_lengths = _real_shape(key_len, seed=2)
    q.copy_(new_q)
    lengths.copy_(new_lengths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, k, v, lengths, key_len))
