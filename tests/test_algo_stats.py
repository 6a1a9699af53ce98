import math

import pytest
import torch

from caspo.algo import AGG_MODES, aggregate, aggregate_denom, masked_mean, masked_whiten

NAN, INF = float("nan"), float("inf")


def ragged_batch():
    """Four rows, T = 4, junk in every padded slot.

    row 0: [1, 2, 3, ·]   L = 3, sum 6
    row 1: [4, ·, ·, ·]   L = 1, sum 4
    row 2: [·, ·, ·, ·]   empty
    row 3: [·, 5, ·, 6]   L = 2, sum 11 (holes)
    N = 6, B' = 3, Σ = 21
    """
    x = torch.tensor(
        [
            [1.0, 2.0, 3.0, NAN],
            [4.0, INF, -INF, NAN],
            [NAN, INF, 7.0, 8.0],
            [-INF, 5.0, NAN, 6.0],
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]], dtype=torch.float32)
    return x, mask


def test_masked_mean_ignores_junk_and_accepts_bool_or_float_mask():
    x, mask = ragged_batch()
    assert masked_mean(x, mask).item() == pytest.approx(21 / 6)
    assert masked_mean(x, mask.bool()).item() == pytest.approx(21 / 6)
    # per row: 6/3, 4/1, empty -> 0, 11/2
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 4.0, 0.0, 5.5], dtype=torch.float64))


def test_masked_whiten_unbiased_and_biased():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, INF]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # values 1..4: mean 2.5, Σ(x-μ)² = 2.25+0.25+0.25+2.25 = 5
    out = masked_whiten(x, mask)
    std = math.sqrt(5 / 3 + 1e-8)
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    biased = masked_whiten(x, mask, unbiased=False)
    std = math.sqrt(5 / 4 + 1e-8)
    torch.testing.assert_close(biased[0], torch.tensor([-1.5 / std, -0.5 / std, 0.5 / std]))
    assert biased[1, 1] == 0 and biased[1, 2] == 0


def test_masked_whiten_rejects_too_few_entries():
    x = torch.tensor([[1.0, 2.0]])
    with pytest.raises(ValueError, match="masked_var: the mask selects a single entry; the unbiased variance"):
        masked_whiten(x, torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="masked_var: the mask selects no entry"):
        masked_whiten(x, torch.tensor([[0, 0]]))


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 21 / 6),
        ("token-sum", 21.0),
        ("seq-mean-token-sum", 21 / 3),
        ("seq-mean-token-mean", (6 / 3 + 4 / 1 + 11 / 2) / 3),
        ("seq-mean-token-sum-norm", 21 / (3 * 4)),
    ],
)
def test_aggregate_modes_by_hand(mode, expected):
    x, mask = ragged_batch()
    out = aggregate(x, mask, mode)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(expected)


def test_aggregate_norm_len_and_explicit_denom():
    x, mask = ragged_batch()
    assert aggregate(x, mask, "seq-mean-token-sum-norm", norm_len=7).item() == pytest.approx(21 / (3 * 7))
    assert aggregate(x, mask, "token-mean", denom=12).item() == pytest.approx(21 / 12)
    assert aggregate(x, mask, "seq-mean-token-sum", denom=torch.tensor(7)).item() == pytest.approx(3.0)
    # seq-mean-token-mean keeps 1/L_i per row; denom replaces B' only
    assert aggregate(x, mask, "seq-mean-token-mean", denom=2).item() == pytest.approx(11.5 / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", denom=6).item() == pytest.approx(21 / 6)


def test_aggregate_denom_counts():
    _, mask = ragged_batch()
    assert aggregate_denom(mask, "token-mean").item() == 6
    assert aggregate_denom(mask, "seq-mean-token-sum").item() == 3
    assert aggregate_denom(mask, "seq-mean-token-mean").item() == 3
    assert aggregate_denom(mask, "seq-mean-token-sum-norm").item() == 12
    assert aggregate_denom(mask, "seq-mean-token-sum-norm", norm_len=10).item() == 30
    assert aggregate_denom(mask, "token-sum") is None


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_of_empty_mask_is_zero(mode):
    x = torch.full((2, 3), NAN)
    out = aggregate(x, torch.zeros(2, 3), mode)
    assert out.item() == 0.0


def test_aggregate_errors():
    x, mask = ragged_batch()
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="aggregate: 'token-sum' has no normaliser, so denom must be None"):
        aggregate(x, mask, "token-sum", denom=3)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("micro", [1, 2, 8])
def test_denom_makes_micro_batches_match_the_full_batch(mode, micro):
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 6
    lengths = torch.tensor([6, 1, 0, 3, 5, 2, 6, 4])  # ragged, one empty row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    x = torch.randn(B, T, generator=gen, dtype=torch.float64).requires_grad_()
    junk = torch.where(mask.bool(), 0.0, NAN)

    full = aggregate(x + junk, mask, mode)
    (grad_full,) = torch.autograd.grad(full, x)

    denom = aggregate_denom(mask, mode, norm_len=T)
    parts = []
    for rows in torch.arange(B).split(micro):
        # each micro-batch trimmed to its own longest row, as a packer would do
        width = max(int(lengths[rows].max()), 1)
        parts.append(aggregate((x + junk)[rows, :width], mask[rows, :width], mode, denom=denom))
    split = torch.stack(parts).sum()
    (grad_split,) = torch.autograd.grad(split, x)

    torch.testing.assert_close(split, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_split, grad_full, atol=1e-6, rtol=0)
    assert not torch.isnan(grad_split).any()
    if denom is not None:  # counts add up over micro-batches (what an all-reduce would sum)
        summed = sum(aggregate_denom(mask[rows], mode, norm_len=T) for rows in torch.arange(B).split(micro))
        assert summed.item() == denom.item()
