"""The fused Gumbel pick (caspo/rollout/gumbel_kernel.py) against the torch pick, on both of its ranking paths.

Without CUDA the kernels run in triton's interpreter (conftest.py sets TRITON_INTERPRET=1). The check of the
float32 noise over every counter value runs on the device with `pytest -m gpu`.
"""

import os

import numpy as np
import pytest
import torch
from test_nucleus import random_logits, sorted_cut

from caspo.rollout.sampling import gumbel_pick, inverse_temperature, noise_row_hash, sample_next, uniform_noise


def device_for_triton() -> str:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton kernels need a GPU or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def gumbel64(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The definition's noise [B, V] in float64, as gumbel_pick draws it."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))


@pytest.mark.parametrize("margin", [None, float("inf")], ids=["float32-ranking", "float64-everywhere"])
@pytest.mark.parametrize("vocab, temperature, top_k, top_p", [  # one part, and three with a partial last one
    (5000, 0.6, 0, 0.9), (5000, 1.0, 40, 1.0), (5000, 0.7, 0, 1.0), (20000, 0.6, 0, 0.9),
    pytest.param(20000, 1.0, 40, 1.0, marks=pytest.mark.slow),
    pytest.param(20000, 0.7, 0, 1.0, marks=pytest.mark.slow)])
def test_fused_pick_equals_the_torch_pick(vocab, temperature, top_k, top_p, margin):
    """The one-kernel pick gives gumbel_pick's tokens and its log-probs, whether a part ranks by float32 keys
    (the default margin) or every part ranks again in float64 (margin inf)."""
    from caspo.rollout.gumbel_kernel import MARGIN, fused_gumbel_pick

    device = device_for_triton()
    logits = random_logits(6, vocab, 3.0, seed=vocab).float()
    logits[5] = 0.0  # a flat row: the noise alone decides
    seeds = torch.tensor([1, 2**40 + 3, 2**62 + 5, 7, 11, 13])
    positions = torch.tensor([0, 1, 5, 100, 4095, 9])
    scaled = logits * inverse_temperature(temperature)
    cut = sorted_cut(scaled, top_k, top_p)
    threshold = None if top_k == 0 and top_p == 1.0 else cut
    got = fused_gumbel_pick(logits.to(device), inverse_temperature(temperature),
                            None if threshold is None else threshold.to(device),
                            seeds.to(device), positions.to(device), MARGIN if margin is None else margin)
    expected = gumbel_pick(scaled, cut, seeds, positions)
    assert torch.equal(got[0].cpu(), expected[0])
    for value, want in zip(got[1:], expected[1:]):
        assert torch.allclose(value.cpu(), want, atol=1e-5)
    via_sampler = sample_next(logits.to(device), seeds.to(device), positions.to(device), temperature, top_k, top_p,
                              fused=True)
    assert torch.equal(via_sampler[0].cpu(), expected[0])


def test_blocks_with_nothing_kept_give_the_torch_pick():
    """Peaked rows at top-p 0.9, whose nucleus is a few tokens: most blocks of a part keep nothing, and their noise
    is not hashed. The tokens and log-probs are still gumbel_pick's, also where one part keeps nothing at all, where
    the kept tokens sit in one block of the last part, and for a flat row, where every block keeps some."""
    from caspo.rollout.gumbel_kernel import fused_gumbel_pick

    device = device_for_triton()
    vocab = 20000  # three parts of 8,192, eight blocks of 1,024 each; the last part partial
    logits = random_logits(8, vocab, 30.0, seed=5).float()
    logits[6] = random_logits(1, vocab, 1.0, seed=6).float()[0]
    logits[6, 17000:17003] = 60.0  # three tokens in one block of the last part; the first two parts keep nothing
    logits[7] = 0.0  # flat: the nucleus is 90% of the row
    seeds, positions = torch.arange(8) * 104729 + 3, torch.arange(8) * 7
    inverse = inverse_temperature(0.6)
    scaled = logits * inverse
    cut = sorted_cut(scaled, 0, 0.9)
    assert (scaled >= cut).sum(-1)[:6].max() < 8 and (scaled[6] >= cut[6]).nonzero()[:, 0].tolist() == [17000, 17001,
                                                                                                            17002]
    for draw in range(3):
        got = fused_gumbel_pick(logits.to(device), inverse, cut.to(device), (seeds + draw).to(device),
                                positions.to(device))
        expected = gumbel_pick(scaled, cut, seeds + draw, positions)
        assert torch.equal(got[0].cpu(), expected[0])
        for value, want in zip(got[1:], expected[1:]):
            assert torch.allclose(value.cpu(), want, atol=1e-5)


@pytest.fixture(scope="module")
def searched():
    """Logits [8, 20000] as in the test above (peaked rows, kept tokens in one block of the last part, a flat
    row), the nucleus search's threshold at top-p 0.9 and T = 0.6, and its sums; searched once for the module
    (a search takes seconds in triton's interpreter)."""
    from caspo.rollout.sampling import NUCLEUS_TOP, _nucleus_threshold_by_kernels

    device = device_for_triton()
    vocab = 20000
    logits = random_logits(8, vocab, 30.0, seed=5).float()
    logits[6] = random_logits(1, vocab, 1.0, seed=6).float()[0]
    logits[6, 17000:17003] = 60.0
    logits[7] = 0.0
    inverse = inverse_temperature(0.6)
    cut, search = _nucleus_threshold_by_kernels(logits.to(device), 0.9, NUCLEUS_TOP, inverse)
    return device, logits, inverse, cut, search


def test_the_searchs_sums_give_the_torch_pick(searched):
    """With the search's sums the pick reads only the blocks that keep something and takes the untruncated
    normalizer from the search's mass: gumbel_pick's tokens, its log-probs to float32 rounding."""
    from caspo.rollout.gumbel_kernel import fused_gumbel_pick

    device, logits, inverse, cut, search = searched
    scaled = logits * inverse
    assert torch.equal(cut.cpu(), sorted_cut(scaled, 0, 0.9))
    seeds, positions = torch.arange(8) * 104729 + 3, torch.arange(8) * 7
    for draw in range(3):
        got = fused_gumbel_pick(logits.to(device), inverse, cut, (seeds + draw).to(device), positions.to(device),
                                search=search)
        expected = gumbel_pick(scaled, cut.cpu(), seeds + draw, positions)
        assert torch.equal(got[0].cpu(), expected[0])
        for value, want in zip(got[1:], expected[1:]):
            assert torch.allclose(value.cpu(), want, atol=1e-5)


def test_the_pick_does_not_read_a_block_the_chunk_maxima_rule_out(searched):
    """A block whose chunks' maxima lie below the cut is skipped unread: planting a huge logit there after the
    search changes nothing with the search's sums, and wins without them."""
    from caspo.rollout.gumbel_kernel import fused_gumbel_pick

    device, logits, inverse, cut, search = searched
    seeds, positions = torch.arange(8) * 104729 + 3, torch.arange(8) * 7
    clean = fused_gumbel_pick(logits.to(device), inverse, cut, seeds.to(device), positions.to(device), search=search)
    planted = logits.clone()
    planted[0, 2048 + 5] = 1e4  # row 0 keeps a few tokens of a peaked row; block 2 of its first part keeps none
    assert search.chunk_maxima[0, 2048 // 128: 3072 // 128].max() < cut[0, 0]
    got = fused_gumbel_pick(planted.to(device), inverse, cut, seeds.to(device), positions.to(device), search=search)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])
    unsearched = fused_gumbel_pick(planted.to(device), inverse, cut, seeds.to(device), positions.to(device))
    assert unsearched[0][0].item() == 2048 + 5


def test_search_sums_need_a_threshold_and_their_shapes(searched):
    from caspo.rollout.gumbel_kernel import fused_gumbel_pick

    device, logits, inverse, cut, search = searched
    counters = torch.arange(8).to(device), torch.arange(8).to(device)
    with pytest.raises(ValueError, match="need a threshold"):
        fused_gumbel_pick(logits.to(device), inverse, None, *counters, search=search)
    with pytest.raises(ValueError, match="maxima"):
        fused_gumbel_pick(logits[:, :10000].contiguous().to(device), inverse, cut, *counters, search=search)


def float32_keys_invert(vocab: int, seeds: torch.Tensor, positions: torch.Tensor, device: str):
    """Logits [1, vocab] whose entries i < j have float64 keys with j ahead by less than a float32 ulp and float32
    keys with i strictly ahead; every other entry is far behind. Returns (logits, i, j)."""
    from caspo.rollout.gumbel_kernel import gumbel_noise32

    g64 = gumbel64(seeds, positions, vocab)[0]
    counters = (torch.from_numpy(uniform_noise(seeds, positions, vocab)[0].numpy() * (1 << 24) - 0.5)
                .round().to(torch.int32))
    g32 = gumbel_noise32(counters.to(device)).cpu()
    s_j = torch.tensor(4.0, dtype=torch.float32)
    for i in range(0, vocab, 3):
        for j in (i + 1, i + 2):  # neighbouring lanes of one part
            # the largest float32 s_i whose float64 key is still behind j's
            s_i = torch.tensor(float(s_j.double() + g64[j] - g64[i]), dtype=torch.float32)
            while s_i.double() + g64[i] >= s_j.double() + g64[j]:
                s_i = torch.nextafter(s_i, torch.tensor(float("-inf")))
            key32_i, key32_j = np.float32(s_i) + np.float32(g32[i]), np.float32(s_j) + np.float32(g32[j])
            if key32_i > key32_j:
                logits = torch.full((1, vocab), -1e4)
                logits[0, i], logits[0, j] = s_i, s_j
                return logits, i, j
    raise AssertionError("no pair of entries whose float32 keys invert their float64 order")


def test_a_near_tie_is_ranked_in_float64():
    """Where the float32 keys put i ahead of j but the float64 keys put j ahead, the pick returns j, as
    gumbel_pick does; with a margin of 0 it would have kept i (so the margin is what decides)."""
    from caspo.rollout.gumbel_kernel import fused_gumbel_pick

    device = device_for_triton()
    seeds, positions = torch.tensor([2**33 + 7]), torch.tensor([17])
    logits, i, j = float32_keys_invert(3000, seeds, positions, device)
    counters = seeds.to(device), positions.to(device)
    assert gumbel_pick(logits, torch.tensor([[float("-inf")]]), seeds, positions)[0].item() == j
    assert fused_gumbel_pick(logits.to(device), 1.0, None, *counters)[0].item() == j
    assert fused_gumbel_pick(logits.to(device), 1.0, None, *counters, margin=0.0)[0].item() == i


try:  # CPU builds of torch come without triton: the test below then skips
    import triton
    import triton.language as tl

    from caspo.rollout.gumbel_kernel import INTERPRETED, _fold_kept, _online_logsumexp, _row_hash

    @triton.jit
    def _row_hashes(Seeds, Positions, Out, n, BLOCK: tl.constexpr):
        index = tl.arange(0, BLOCK)
        inside = index < n
        h = _row_hash(tl.load(Seeds + index, mask=inside, other=0), tl.load(Positions + index, mask=inside, other=0))
        tl.store(Out + index, h.to(tl.int64), mask=inside)

    @triton.jit
    def _fold_both_ways(X, Out, n, cut, LANES: tl.constexpr, FAST: tl.constexpr):
        """The running (max, sum) of each lane's entries by `_online_logsumexp`, and by exponentiating both
        differences from the new max (what it replaced); and the sum over the entries >= cut by `_fold_kept`."""
        lanes = tl.arange(0, LANES)
        top = tl.full([LANES], float("-inf"), tl.float32)
        total = tl.zeros([LANES], tl.float32)
        two_top = tl.full([LANES], float("-inf"), tl.float32)
        two_total = tl.zeros([LANES], tl.float32)
        kept_total = tl.zeros([LANES], tl.float32)
        for i in range(0, n):
            s = tl.load(X + i * LANES + lanes)
            top, total, e, rises = _online_logsumexp(top, total, s, FAST)
            kept_total = _fold_kept(kept_total, s >= cut, e, rises)
            new_top = tl.maximum(two_top, s)
            anchor = tl.where(new_top == float("-inf"), 0.0, new_top)
            two_total = two_total * tl.exp(two_top - anchor) + tl.exp(s - anchor)
            two_top = new_top
        tl.store(Out + lanes, top)
        tl.store(Out + LANES + lanes, total)
        tl.store(Out + 2 * LANES + lanes, two_top)
        tl.store(Out + 3 * LANES + lanes, two_total)
        tl.store(Out + 4 * LANES + lanes, kept_total)
except ImportError:
    _fold_both_ways = None


def test_the_kernels_row_hash_is_the_torch_one():
    """The pick hashes each row's (seed, position) itself: the same 32-bit values as `noise_row_hash`, over seeds
    and positions at and across the 32-bit boundaries."""
    device = device_for_triton()
    seeds = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**33 + 7, 2**62 + 5, 2**63 - 1, 123456789012345])
    positions = torch.tensor([0, 1, 5, 2**31 - 1, 2**31, 2**32 + 3, 4095, 17, 2**40 + 1, 9])
    out = torch.empty(len(seeds), dtype=torch.int64, device=device)
    _row_hashes[(1,)](seeds.to(device), positions.to(device), out, len(seeds), BLOCK=16)
    assert torch.equal(out.cpu(), noise_row_hash(seeds, positions))


def test_the_online_logsumexp_takes_one_exponential_for_two():
    """The pick's running (max, sum) with e = exp(-|s - top|) an entry equals the fold that exponentiates both
    differences from the new max, through rising, falling, equal and -inf entries (bit for bit in the interpreter;
    on a card to a rounding, as the compiler may fuse either multiply-add), and the float64 logsumexp; the kept
    sum folded from the same exponentials gives the float64 logsumexp over the entries at or above the cut."""
    device = device_for_triton()

    inf = float("inf")
    lanes = [[-inf] * 6, [-inf, 3.0, 1.0, 5.0, 5.0, -inf], [4.0, 2.0, -1.0, -inf, -3.0, -7.5],
             [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], [-inf, -inf, 2.0, -inf, 9.0, 8.0]]
    lanes += torch.randn(11, 6, generator=torch.Generator().manual_seed(0)).mul(4).tolist()
    x = torch.tensor(lanes, dtype=torch.float32).T.contiguous()  # [steps, lanes]
    out = torch.empty(5, 16, dtype=torch.float32, device=device)
    cut = 1.0
    _fold_both_ways[(1,)](x.to(device), out, x.shape[0], cut, LANES=16, FAST=not INTERPRETED)
    top, total, two_top, two_total, kept_total = out.cpu()
    assert torch.equal(top, two_top)
    if device == "cpu":
        assert torch.equal(total, two_total)
    else:
        torch.testing.assert_close(total, two_total, atol=0, rtol=2e-7)
    assert top[0] == -inf and total[0] == 0
    finite = top > -inf
    expected = torch.logsumexp(x.T.double(), -1)
    torch.testing.assert_close((top + total.log())[finite].double(), expected[finite], atol=1e-6, rtol=1e-6)
    # the kept sum shares the lane's max: its logsumexp is the float64 one over the entries >= cut
    x64 = x.T.double()
    kept = torch.logsumexp(x64.masked_fill(x64 < cut, -inf), -1)
    has_kept = (x.T >= cut).any(-1)
    assert 0 < has_kept.sum() < len(lanes) and (kept_total[~has_kept] == 0).all()
    torch.testing.assert_close((top + kept_total.log())[has_kept].double(), kept[has_kept], atol=1e-6, rtol=1e-6)


def check_noise32(counters: torch.Tensor, device: str) -> float:
    """The largest |float32 G - float64 G| over the counter values k [n]."""
    from caspo.rollout.gumbel_kernel import gumbel_noise32

    exact = -torch.log(-torch.log((counters.double() + 0.5) / (1 << 24)))
    return float((gumbel_noise32(counters.to(device)).cpu().double() - exact).abs().max())


def test_float32_noise_is_far_inside_the_margin():
    """G in float32 stays within 2e-6 of the float64 definition at sampled counters, the ends, where U stops being
    exact in float32 (U = 1/2) and where the series takes over from the logarithm (U = 1 - 2^-4), far inside
    MARGIN; the device check of every counter is test_float32_noise_on_the_device."""
    from caspo.rollout.gumbel_kernel import MARGIN

    device = device_for_triton()
    series_from = (1 << 24) - (1 << 20)
    edges = [0, 1, 2, (1 << 23) - 1, 1 << 23, (1 << 23) + 1, series_from - 1, series_from, series_from + 1,
             (1 << 24) - 2, (1 << 24) - 1]
    counters = torch.cat([torch.arange(0, 1 << 24, 4093), torch.tensor(edges)]).to(torch.int32)
    error = check_noise32(counters, device)
    assert error < 2e-6 < MARGIN / 8


@pytest.mark.gpu
def test_float32_noise_on_the_device():
    """Every one of the 2^24 counter values: the hardware's float32 logarithms (2-3 ulps) keep G within 8e-6 of
    float64, so two keys' difference errs by less than a quarter of MARGIN."""
    from caspo.rollout.gumbel_kernel import MARGIN

    assert torch.cuda.is_available()
    error = check_noise32(torch.arange(1 << 24, dtype=torch.int32), "cuda")
    assert error < 8e-6 < MARGIN / 4
