"""The native runner's GEMM layouts (`rollout/native/linears.py`): a down projection's float32 partials over spans
of K, what the next norm's kernel makes of them, and when a decode step takes them."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from caspo.rollout.native.linears import DOWN_SPLITS, down_splits, settled, split_linear
from caspo.rollout.native.runner import MLP, add_rms_norm


def test_partials_are_the_products_of_each_span_of_k_and_sum_to_the_linear():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 3, 24, generator=g), torch.randn(7, 24, generator=g)
    partials = split_linear(x, weight, 3)
    assert partials.shape == (3, 5, 3, 7) and partials.dtype == torch.float32
    for s in range(3):  # span s is K's columns [8 s, 8 s + 8)
        torch.testing.assert_close(partials[s], x[..., 8 * s:8 * s + 8] @ weight[:, 8 * s:8 * s + 8].T)
    torch.testing.assert_close(settled(partials, x), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="5 spans do not divide K = 24"):
        split_linear(x, weight, 5)


def test_settled_rounds_the_sum_once_as_a_gemm_rounds_its_accumulator():
    # 1 + 3·2^-10 and 3·2^-10 sum to 1 + 6·2^-10, which is nearer 1 + 2^-7 than 1 in bf16 (spacing 2^-7 at 1);
    # rounded one by one and then added, they would give 1.
    partials = torch.tensor([1 + 3 * 2**-10, 3 * 2**-10])[:, None]
    x = torch.zeros(1, dtype=torch.bfloat16)
    assert settled(partials, x).item() == 1 + 2**-7
    assert (partials[0].bfloat16() + partials[1].bfloat16()).item() == 1.0
    same = torch.randn(4, dtype=torch.bfloat16)
    assert settled(same, same) is same  # a GEMM's own output passes as it is


def test_add_rms_norm_takes_partials_for_the_output_they_sum_to():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(6, 1, 32, generator=g), torch.randn(16, 32, generator=g)
    residual, norm = torch.randn(6, 1, 16, generator=g), 1 + 0.1 * torch.randn(16, generator=g)
    got = add_rms_norm(residual, split_linear(x, weight, 4), norm, 1e-6)
    want = add_rms_norm(residual, F.linear(x, weight), norm, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_decode_rows_take_the_split_table_and_a_prefill_one_gemm():
    assert [down_splits(rows, 8960) for rows, _ in DOWN_SPLITS] == [spans for _, spans in DOWN_SPLITS]
    assert [down_splits(1, 8960), down_splits(97, 8960), down_splits(257, 8960)] == [2, 4, 1]
    assert down_splits(DOWN_SPLITS[-1][0] + 1, 8960) == 1 and down_splits(8192, 8960) == 1
    assert down_splits(256, 8968) == 1  # 8968 / 4 spans is not a whole number of 8-element vectors
    assert down_splits(512, 8968) == 1 and down_splits(512, 8976) == 2


def test_mlp_on_the_cpu_hands_the_next_norm_its_plain_output():
    mlp = MLP(SimpleNamespace(hidden_size=16, intermediate_size=64), torch.float32)
    mlp.fuse()
    x = torch.randn(256, 1, 16)
    out = mlp.deferred(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, mlp(x))


@pytest.mark.gpu
def test_on_cuda_a_decode_step_leaves_partials_within_the_gemms_rounding():
    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=1536, intermediate_size=8960), torch.bfloat16).cuda()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    mlp.fuse()
    for rows, spans in ((256, 4), (512, 2), (960, 1), (8192, 1)):
        x = torch.randn(rows, 1, 1536, device="cuda", dtype=torch.bfloat16)
        out = mlp.deferred(x)
        assert out.dim() == (4 if spans > 1 else 3) and (spans == 1 or out.shape[0] == spans)
        want = mlp(x)
        got = settled(out, x)
        assert got.dtype == torch.bfloat16
        # one GEMM and the partials sum K in other orders; both round once to bf16 (2^-8 relative)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=2**-7)
