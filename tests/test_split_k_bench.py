"""benchmarks/split_k_bench.py's kernels in Triton's CPU interpreter: the split-K GEMM with the residual add and
RMSNorm in its reduction gives the engine's `add_rms_norm(residual, x Wᵀ)` (float32 here: the interpreter
does not multiply bf16 tiles; bf16 is checked on a card)."""

import sys
from pathlib import Path

import pytest
import torch

from caspo.rollout.native.runner import _rms_norm, silu_mul

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from split_k_bench import split_k_add_rms_norm  # noqa: E402


@pytest.mark.parametrize("rows, depth, cols, config", [
    (5, 40, 24, (16, 16, 16, 3, 4, 1)),   # K in 3 spans of 16 (the last holds 8), rows and columns past the tiles
    (7, 64, 32, (16, 32, 32, 4, 4, 1)),   # 4 splits asked, 2 of a whole 32-step span: no empty split
    (3, 33, 20, (16, 16, 16, 1, 4, 1)),   # one split: the plain GEMM
])
def test_split_k_gives_the_residual_sum_and_its_norm(rows, depth, cols, config):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, depth, generator=g), torch.randn(cols, depth, generator=g)
    residual, norm_weight = torch.randn(rows, cols, generator=g), 1 + 0.1 * torch.randn(cols, generator=g)
    out, normed = split_k_add_rms_norm(x, weight, residual, norm_weight, 1e-6, config)
    want = residual.double() + x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, _rms_norm(out, norm_weight, 1e-6), atol=1e-6, rtol=1e-6)
    assert (normed - _rms_norm(residual, norm_weight, 1e-6)).abs().max() > 0.1  # the GEMM's sum is in it


def test_the_gated_input_is_silu_mul_of_the_gate_up_output():
    g = torch.Generator().manual_seed(0)
    gate_up, weight = torch.randn(6, 2 * 40, generator=g), torch.randn(24, 40, generator=g)
    residual, norm_weight = torch.randn(6, 24, generator=g), torch.ones(24)
    out, _ = split_k_add_rms_norm(gate_up, weight, residual, norm_weight, 1e-6, (16, 16, 16, 2, 4, 1), gated=True)
    torch.testing.assert_close(out.double(), residual.double() + silu_mul(gate_up).double() @ weight.double().T,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="80"):  # not gated, the input has 80 features for a weight of 40
        split_k_add_rms_norm(gate_up, weight, residual, norm_weight, 1e-6, (16, 16, 16, 2, 4, 1))


@pytest.mark.gpu
def test_on_cuda_in_bf16_within_the_rounding_of_the_engines_kernels():
    """bf16 on the card (Triton's interpreter does not multiply bf16 tiles): each output is within one bf16
    rounding of the engine's, whose cuBLAS GEMM sums in another order."""
    import torch.nn.functional as F

    from caspo.rollout.native.runner import add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 8960, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(1536, 8960, device="cuda", generator=g) * 8960 ** -0.5).bfloat16()
    residual = torch.randn(256, 1536, device="cuda", generator=g).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(1536, device="cuda", generator=g)).bfloat16()
    gate_up = torch.randn(256, 2 * 8960, device="cuda", generator=g).bfloat16()
    for got, want in [
        (split_k_add_rms_norm(x, weight, residual, norm_weight, 1e-6, (128, 128, 64, 6, 8, 4)),
         add_rms_norm(residual, F.linear(x, weight), norm_weight, 1e-6)),
        (split_k_add_rms_norm(gate_up, weight, residual, norm_weight, 1e-6, (128, 128, 64, 6, 8, 4), gated=True),
         add_rms_norm(residual, F.linear(silu_mul(gate_up), weight), norm_weight, 1e-6)),
    ]:
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
