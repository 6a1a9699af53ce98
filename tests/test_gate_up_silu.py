"""The gate/up GEMM with SiLU·up in its epilogue (`gate_up_silu.py`) against cuBLAS + `silu_mul`'s formula: in
Triton's CPU interpreter in float16 (it does not multiply bf16 tiles), and in bf16 on a card."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from caspo.rollout.native import linears
from caspo.rollout.native.gate_up_silu import gate_up_silu
from caspo.rollout.native.linears import gate_up_config

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from gate_up_silu_bench import gate_up_table, parse_rows  # noqa: E402


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each GEMM output rounded to x's dtype, SiLU in float32 rounded, the product rounded: the engine's path."""
    gate, up = F.linear(x.double(), weight.double()).to(x.dtype).chunk(2, dim=-1)
    return (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


@pytest.mark.parametrize("rows, depth, inter, config", [
    (5, 40, 24, (16, 16, 16, 4, 1, False)),   # rows, K and columns past their tiles (24 columns in blocks of 16)
    (33, 64, 32, (32, 32, 32, 4, 1, False)),  # two row tiles, whole column blocks
    (33, 64, 32, (32, 32, 32, 4, 1, True)),   # the same through tensor descriptors
])
def test_the_epilogue_gives_silu_of_the_gate_times_the_up(rows, depth, inter, config):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, depth, generator=g).half()
    weight = (torch.randn(2 * inter, depth, generator=g) * depth ** -0.5).half()
    got, want = gate_up_silu(x, weight, config), reference(x, weight)
    assert got.shape == (rows, inter) and got.dtype == torch.float16
    # the GEMM sums in float32, the reference in float64: at most one float16 rounding apart, and mostly equal
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert (got == want).float().mean() > 0.9
    gate_only = F.silu(F.linear(x.float(), weight[:inter].float()))  # the up half really multiplies
    assert (got.float() - gate_only).abs().max() > 0.1


def test_a_weight_that_is_not_gate_and_up_over_x_is_refused():
    with pytest.raises(ValueError, match="not \\[gate; up\\]"):
        gate_up_silu(torch.zeros(2, 8).half(), torch.zeros(6, 16).half(), (16, 16, 16, 4, 1, False))
    with pytest.raises(ValueError, match="whole tiles of 16"):  # 24 columns: a gate tile would read up rows
        gate_up_silu(torch.zeros(2, 8).half(), torch.zeros(48, 8).half(), (16, 16, 16, 4, 1, True))


def test_the_config_table_is_read_by_rows_on_the_card_it_was_measured_on(monkeypatch):
    small, large = (64, 64, 64, 4, 4, False), (128, 128, 64, 8, 4, True)
    monkeypatch.setattr(linears, "GATE_UP_CONFIGS", ((64, small), (128, None), (256, large)))
    hopper = linears.GATE_UP_CAPABILITY
    assert [gate_up_config(r, 1536, 8960, hopper) for r in (1, 64, 65, 128, 129, 256, 257)] == [
        small, small, None, None, large, large, None]
    assert gate_up_config(64, 1536, 8960, hopper + 1) is None  # another card: cuBLAS + silu_mul
    assert gate_up_config(256, 1536, 8960 - 64, hopper) is None  # a half not in whole 128-column tiles
    assert gate_up_config(64, 1536 + 4, 8960, hopper) is None  # rows not in whole 16-byte vectors


def test_the_benchmark_writes_the_table_from_the_sizes_that_won_by_the_gain():
    wide, square = (64, 128, 64, 4, 4, True), (64, 64, 64, 4, 4, True)
    sizes = [(1, 23.6, wide, 22.8), (8, 24.1, wide, 23.0),  # 1.035 and 1.05 x: one entry for both
             (16, 24.3, square, 22.8),
             (144, 29.7, square, 31.3), (160, 30.2, wide, 29.8),  # slower, then only 1.01 x: cuBLAS for both
             (192, 34.2, square, 29.8),
             (256, 31.6, square, 35.3), (384, 43.3, None, 0.0)]  # slower, then nothing ran: no trailing entry
    assert gate_up_table(sizes, 1.03) == ((8, wide), (16, square), (160, None), (192, square))
    assert gate_up_table(sizes, 1.10) == ((160, None), (192, square))
    assert parse_rows("64,256") == [64, 256]
    graphs = parse_rows("graphs")
    assert graphs[:5] == [1, 2, 4, 8, 16] and graphs[-1] == 1024 and 960 in graphs


def test_every_config_in_the_table_fits_the_seed_shape():
    hopper = linears.GATE_UP_CAPABILITY
    for most_rows, config in linears.GATE_UP_CONFIGS:
        assert gate_up_config(most_rows, 1536, 8960, hopper) == config


@pytest.mark.gpu
def test_on_cuda_in_bf16_within_one_rounding_of_cublas_and_silu_mul():
    from caspo.rollout.native.runner import silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1536, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(2 * 8960, 1536, device="cuda", generator=g) * 1536 ** -0.5).bfloat16()
    want = silu_mul(F.linear(x, weight))
    for config in ((128, 64, 64, 8, 4, False), (64, 64, 128, 4, 3, True)):
        got = gate_up_silu(x, weight, config)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
        assert (got == want).float().mean() > 0.9
