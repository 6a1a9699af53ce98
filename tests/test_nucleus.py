"""The sort-free top-p threshold: hand-derived cases, agreement with the sorted definition, the sampler's tokens.

The GPU tests (the fused sampler against the eager one, CUDA graph replay) run with `pytest -m gpu`.
"""

import math
import os

import pytest
import torch

from caspo.rollout.sampling import (
    _ONE_BITS,
    NUCLEUS_PIVOTS,
    NUCLEUS_TOP,
    _masses,
    _nucleus_plan,
    _threshold_among_top,
    cut_threshold,
    gumbel_pick,
    inverse_temperature,
    largest_values,
    narrow_by_torch,
    nucleus_threshold,
    sample_next,
    truncate_logits,
)

LN2 = math.log(2)
NEG_INF = float("-inf")


def sorted_threshold(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The pre-change definition, by sorting: the smallest logit of the most likely tokens, taken in order while
    the mass before them is below top_p (ties with the last one are kept by the `>=` of the callers)."""
    ordered = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered, dim=-1)
    in_nucleus = (probs.cumsum(-1) - probs) < top_p
    return ordered.gather(-1, in_nucleus.sum(-1, keepdim=True) - 1)


def sorted_cut(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The pre-change cut_threshold: top-k by torch.topk, then the sorted nucleus of what is left."""
    threshold = logits.new_full((logits.shape[0], 1), NEG_INF)
    if 0 < top_k < logits.shape[-1]:
        threshold = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        threshold = sorted_threshold(logits.masked_fill(logits < threshold, NEG_INF), top_p)
    return threshold


def boundary_margin(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row, in float64: how far top_p is from flipping the last kept group, min(top_p - mass strictly above
    it, mass through it - top_p). Rows with a tiny margin may legitimately differ under other rounding."""
    x = logits.double()
    threshold = sorted_threshold(x, top_p)
    p = torch.softmax(x, -1)
    above = (p * (x > threshold)).sum(-1)
    through = (p * (x >= threshold)).sum(-1)
    return torch.minimum(top_p - above, through - top_p)


def kept(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return logits >= threshold


# ---------------------------------------------------------------- hand-derived cases

# p = 1/2, 1/4, 1/8, 1/16, 1/16: float32 exp of these logits is exact, so every sum below is exact
DYADIC = [0.0, -LN2, -2 * LN2, -3 * LN2, -3 * LN2]


def test_dyadic_logits_have_exact_probabilities():
    x = torch.tensor([DYADIC])
    assert torch.exp(x - x.amax()).tolist() == [[1.0, 0.5, 0.25, 0.125, 0.125]]


@pytest.mark.parametrize("top_p, expected", [
    (0.1, [1, 0, 0, 0, 0]),
    (0.5, [1, 0, 0, 0, 0]),         # exactly the mass of the first token: it alone reaches top_p
    (0.5000001, [1, 1, 0, 0, 0]),
    (0.75, [1, 1, 0, 0, 0]),        # exactly 1/2 + 1/4
    (0.8, [1, 1, 1, 0, 0]),
    (0.875, [1, 1, 1, 0, 0]),       # exactly 1/2 + 1/4 + 1/8
    (0.9, [1, 1, 1, 1, 1]),         # the fourth token is needed and the fifth ties with it
    (0.999, [1, 1, 1, 1, 1]),
    (1.0, [1, 1, 1, 1, 1]),         # no cut at all
])
def test_hand_derived_nucleus(top_p, expected):
    x = torch.tensor([DYADIC])
    assert kept(x, cut_threshold(x, 0, top_p)).int().tolist() == [expected]
    assert kept(x, sorted_cut(x, 0, top_p)).int().tolist() == [expected]  # the old definition agrees
    if top_p < 1.0:
        assert kept(x, nucleus_threshold(x, top_p)).int().tolist() == [expected]


def test_hand_derived_rows_in_one_batch():
    rows = torch.tensor([
        DYADIC,
        [3.7, 3.7, 3.7, 3.7, 3.7],              # uniform: every token tied, all kept at any top_p
        [30.0, -30.0, -30.0, -30.0, -30.0],     # one-hot in float32: the others weigh nothing
        [1.0, NEG_INF, 0.0, NEG_INF, 0.5],      # masked by top-k: p = 0 is never kept
        [0.0, -LN2, -LN2 * 3, -LN2 * 3, -LN2 * 3],  # 8/14, 4/14, 1/14 x 3: ties at the cut
    ])
    threshold = nucleus_threshold(rows, 0.6)
    assert kept(rows, threshold).int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 0, 0, 0, 1],   # p ∝ e, 1, e^0.5: 0.506 then 0.307
        [1, 1, 0, 0, 0],   # 8/14 = 0.571 < 0.6, 12/14 reaches it
    ]
    assert kept(rows, nucleus_threshold(rows, 0.9)).int().tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 0, 1, 0, 1],   # the finite tokens carry all the mass, the masked ones none
        [1, 1, 1, 1, 1],   # 12/14 = 0.857 < 0.9: one more 1/14 token, and its two ties
    ]
    assert torch.isfinite(nucleus_threshold(rows, 0.999999)).all()
    assert kept(rows, nucleus_threshold(rows, 0.999999))[3].tolist() == [True, False, True, False, True]


def test_top_k_masking_then_nucleus():
    x = torch.tensor([DYADIC])
    # top-3 leaves 1/2, 1/4, 1/8, renormalised to 4/7, 2/7, 1/7
    for top_p, expected in [(0.5, [1, 0, 0, 0, 0]), (0.6, [1, 1, 0, 0, 0]), (0.9, [1, 1, 1, 0, 0]),
                            (0.9999, [1, 1, 1, 0, 0]), (1.0, [1, 1, 1, 0, 0])]:
        assert (truncate_logits(x, 3, top_p) > NEG_INF).int().tolist() == [expected]
    # a tie at the k-th logit keeps both tied tokens, as before
    assert (truncate_logits(x, 4, 0.999) > NEG_INF).int().tolist() == [[1, 1, 1, 1, 1]]


def test_top_p_zero_keeps_the_most_likely_tokens():
    x = torch.tensor([[0.5, 2.0, 2.0, -1.0]])
    assert kept(x, nucleus_threshold(x, 0.0)).tolist() == [[False, True, True, False]]


# ---------------------------------------------------------------- agreement with the sorted definition

def random_logits(batch: int, vocab: int, std: float, seed: int, grid: float = 0.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=generator) * std
    if grid:  # many exact ties
        x = (x / grid).round() * grid
    return x


CASES = [  # (batch, vocab, std, top_p, grid): flat to peaked, with and without ties
    (64, 1000, 0.5, 0.9, 0.0), (64, 1000, 3.0, 0.5, 0.0), (64, 1000, 10.0, 0.95, 0.0), (64, 1000, 1.0, 0.9, 0.05),
    (32, 8192, 1.0, 0.99, 0.0), (32, 8192, 2.0, 0.3, 0.01), (16, 50000, 1.0 / 0.6, 0.9, 0.0),
    (16, 50000, 8.0 / 0.6, 0.9, 0.0), (16, 50000, 3.0, 0.95, 0.02),
]


@pytest.mark.parametrize("candidates", [0, NUCLEUS_TOP])  # the search alone, and with the top candidates first
@pytest.mark.parametrize("batch, vocab, std, top_p, grid", CASES)
def test_same_kept_set_as_the_sort(batch, vocab, std, top_p, grid, candidates):
    x = random_logits(batch, vocab, std, seed=vocab + int(10 * std), grid=grid)
    threshold = nucleus_threshold(x, top_p, candidates=candidates)
    # exactness: the threshold is one of the row's logits, the smallest one kept
    assert (x == threshold).any(-1).all()
    assert torch.equal(threshold, torch.where(x >= threshold, x, float("inf")).amin(-1, keepdim=True))
    # the sorted definition evaluated in float64 rounds far below the margins that matter
    margin = boundary_margin(x, top_p)
    close = margin < 1e-7
    assert close.float().mean() <= 0.05
    expected = kept(x, sorted_threshold(x.double(), top_p).float())
    assert torch.equal(kept(x, threshold)[~close], expected[~close])
    # the old float32 code: its cumsum rounds by up to a few 1e-6 at 50k tokens, and only there may it differ
    differ = (kept(x, threshold) != kept(x, sorted_threshold(x, top_p))).any(-1)
    assert (margin[differ] < 1e-5).all()


@pytest.mark.parametrize("batch, vocab, std, top_p, grid", CASES)
def test_the_top_candidates_give_the_searchs_threshold(batch, vocab, std, top_p, grid):
    """Rows whose few likeliest tokens hold top_p take their threshold from them, bit for bit the search's."""
    x = random_logits(batch, vocab, std, seed=vocab + int(10 * std), grid=grid)
    assert torch.equal(nucleus_threshold(x, top_p), nucleus_threshold(x, top_p, candidates=0))


def test_peaked_rows_are_resolved_by_their_top_candidates_and_flat_rows_search():
    x = torch.cat([random_logits(4, 5000, 12.0, seed=1), random_logits(4, 5000, 0.5, seed=2)])
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift = _nucleus_plan(5000, 0.9, NUCLEUS_PIVOTS)[0]
    target = ((e * 2.0 ** shift).to(torch.int64).sum(-1, keepdim=True).double() * 0.9).ceil().to(torch.int64)
    found, resolved = _threshold_among_top(e, target, shift, NUCLEUS_TOP)
    assert resolved[:4].all() and not resolved[4:].any()
    threshold = nucleus_threshold(x, 0.9)  # a resolved row's pattern is its threshold's e
    assert torch.equal(found[:4].to(torch.int32).view(torch.float32),
                       torch.exp(threshold[:4] - x[:4].amax(-1, keepdim=True)))


@pytest.mark.parametrize("vocab, chunk", [(16384, 128), (50000, 128), (1000, 8), (1003, 8)])
def test_largest_values_from_chunks_equal_topk(vocab, chunk):
    """The chunked search returns top-k's values, ties included: distinct floats, a coarse grid of ties,
    bf16-rounded logits, rows of one value, -inf from a top-k mask, and a row whose top sits in one chunk."""
    count = 64
    distinct = random_logits(4, vocab, 2.0, seed=vocab)
    rows = [distinct, (distinct / 0.5).round() * 0.5, distinct.bfloat16().float(), torch.zeros(2, vocab)]
    masked = distinct.clone()
    masked[:, vocab // 3:] = NEG_INF
    crowded = torch.full((2, vocab), -5.0)
    crowded[:, chunk:2 * chunk] = torch.linspace(0.0, 1.0, chunk)  # every large value in a single chunk
    crowded[1, -1] = 3.0  # and the largest one in the padded last chunk
    assert vocab > count * chunk  # the chunked path, not the plain top-k of a short row
    for x in [*rows, masked, crowded]:
        assert torch.equal(largest_values(x, count, chunk), x.topk(count, dim=-1).values)


def test_the_result_does_not_depend_on_the_pivots():
    x = random_logits(8, 3000, 1.5, seed=3)
    for top_p in (0.2, 0.9, 0.999):
        reference = nucleus_threshold(x, top_p)
        for pivots in (1, 2, 3, 15, 31):
            assert torch.equal(nucleus_threshold(x, top_p, pivots), reference)


def test_search_plan():
    shift, first, plan = _nucleus_plan(151936, 0.9, 7)
    assert shift == 44 and first == (127 - 23) << 23  # 2^-23 <= 0.1 / (4 * 151936)
    assert plan == [7] * 9 + [1]
    assert len(_nucleus_plan(151936, 0.9, 15)[2]) == 7
    for vocab, top_p, pivots in [(5, 0.5, 7), (151936, 0.999999, 3), (1000, 1 - 1e-15, 7), (2, 0.9, 1)]:
        shift, first, plan = _nucleus_plan(vocab, top_p, pivots)
        width = (127 << 23) - first + 1
        for m in plan:
            width = -(-width // (m + 1))
        assert width == 1 and max(plan) <= pivots
        assert vocab * 2 ** shift <= 2 ** 62


def test_bfloat16_logits():
    x = random_logits(4, 2000, 2.0, seed=5).bfloat16()
    threshold = nucleus_threshold(x, 0.9)
    assert threshold.dtype == torch.bfloat16 and (x == threshold).any(-1).all()
    assert torch.equal(kept(x, threshold), kept(x.float(), nucleus_threshold(x.float(), 0.9)))


# ---------------------------------------------------------------- the sampler

@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 0, 0.9), (1.0, 40, 0.95), (0.8, 0, 0.5), (1.0, 0, 1.0)])
def test_sample_next_tokens_unchanged(temperature, top_k, top_p):
    logits = random_logits(48, 6000, 3.0, seed=11)
    seeds = torch.arange(48) * 7919 + 17
    positions = torch.arange(48) % 13
    tokens, logprobs, full = sample_next(logits, seeds, positions, temperature, top_k, top_p)
    scaled = logits * inverse_temperature(temperature)
    expected = gumbel_pick(scaled, sorted_cut(scaled, top_k, top_p), seeds, positions)
    assert torch.equal(tokens, expected[0])
    assert torch.allclose(logprobs, expected[1], atol=1e-5)
    assert torch.allclose(full, expected[2], atol=1e-5)


def needs_triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton kernels need a GPU or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab, m", [(700, 15), (9000, 7), (17000, 3)])
def test_mass_kernel_equals_the_torch_sums(vocab, m):
    """The Triton pass (triton's interpreter on the CPU) gives the torch path's integer sums, bit for bit."""
    device = needs_triton()
    from caspo.rollout.mass_above import mass_above

    x = random_logits(3, vocab, 2.0, seed=vocab).float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift = 62 - (vocab - 1).bit_length()
    levels = torch.sort(e[:, torch.randperm(vocab)[:m]], dim=-1).values  # levels that split the rows
    levels[0, 0] = 0.0  # everything: the row's total mass
    got = mass_above(e.to(device), levels.to(device), shift).cpu()
    assert torch.equal(got, _masses(e, levels, shift))
    assert got[0, 0] == (e[0] * 2.0 ** shift).to(torch.int64).sum()
    skip = torch.tensor([False, True, False])  # a row resolved before the passes is not read
    skipped = mass_above(e.to(device), levels.to(device), shift, skip.to(device)).cpu()
    assert torch.equal(skipped[~skip], got[~skip]) and skipped[1].eq(0).all()


@pytest.mark.parametrize("vocab, top_p", [(700, 0.5), (9000, 0.95)])  # one part; two, the last partial
def test_narrowing_kernels_equal_the_torch_passes(vocab, top_p):
    """mass_above.narrow (triton's interpreter on the CPU) narrows every row's interval as the torch pass does,
    pass after pass, a resolved row left as it is."""
    device = needs_triton()
    from caspo.rollout.mass_above import narrow

    x = random_logits(4, vocab, 2.0, seed=vocab).float()
    x[3] = x[3] * 20  # peaked: resolved by its top candidates, so it skips the passes
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift, first, plan = _nucleus_plan(vocab, top_p, NUCLEUS_PIVOTS)
    target = (_masses(e, e.new_zeros(4, 1), shift).double() * top_p).ceil().to(torch.int64)
    found, resolved = _threshold_among_top(e, target, shift, 8)
    assert resolved[:, 0].tolist() == [False, False, False, True]
    lo, hi = torch.where(resolved, found, first), torch.where(resolved, found, _ONE_BITS)
    k_lo, k_hi = lo[:, 0].clone().to(device), hi[:, 0].clone().to(device)
    skip = resolved[:, 0].to(torch.int8).to(device)
    for m in plan:
        lo, hi = narrow_by_torch(e, lo, hi, target, resolved, shift, m)
        narrow(e.to(device), k_lo, k_hi, target[:, 0].to(device), skip, shift, m)
        assert torch.equal(k_lo.cpu(), lo[:, 0]) and torch.equal(k_hi.cpu(), hi[:, 0])
    assert torch.equal(lo, hi)  # one bit pattern: the threshold
    assert torch.equal(lo[3], found[3])


@pytest.mark.parametrize("bound", [None, 0.5])  # the kernel's bound; one under which no row is sure
def test_screened_narrowing_equals_the_torch_passes(bound):
    """mass_above.screened_narrow decides on float32 sums where they surely decide, else by the int64 pass: the
    torch pass's interval, pass after pass, whichever rows the screen settles."""
    device = needs_triton()
    from caspo.rollout.mass_above import SCREEN_BOUND, screened_narrow

    vocab, top_p = 9000, 0.9
    x = random_logits(4, vocab, 2.0, seed=5).float()
    x[3] = x[3] * 20  # resolved: skipped by both
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift, first, plan = _nucleus_plan(vocab, top_p, NUCLEUS_PIVOTS)
    target = (_masses(e, e.new_zeros(4, 1), shift).double() * top_p).ceil().to(torch.int64)
    found, resolved = _threshold_among_top(e, target, shift, 8)
    lo, hi = torch.where(resolved, found, first), torch.where(resolved, found, _ONE_BITS)
    k_lo, k_hi = lo[:, 0].clone().to(device), hi[:, 0].clone().to(device)
    skip = resolved[:, 0].to(torch.int8).to(device)
    screened = []
    for m in plan[:5]:
        lo, hi = narrow_by_torch(e, lo, hi, target, resolved, shift, m)
        settled = screened_narrow(e.to(device), k_lo, k_hi, target[:, 0].to(device), skip, shift, m,
                                  SCREEN_BOUND if bound is None else bound)
        assert torch.equal(k_lo.cpu(), lo[:, 0]) and torch.equal(k_hi.cpu(), hi[:, 0])
        screened.append(settled[:3].sum().item())
    assert screened[0] == (3 if bound is None else 0)  # the first pass's levels are far from T


@pytest.mark.parametrize("std", [0.5, 3.0])
def test_the_first_pass_screened_with_the_exponentials_narrows_as_the_int64_pass(std):
    """exp_and_mass's screen of the first pass (every row's levels, summed as e is written) narrows each row as the
    int64 pass does, and leaves a resolved row as it is."""
    device = needs_triton()
    from caspo.rollout.mass_above import narrow, screened_narrow
    from caspo.rollout.nucleus_reads import exp_and_mass

    vocab = 20000
    x = random_logits(4, vocab, std, seed=21).float().to(device)
    shift, first, plan = _nucleus_plan(vocab, 0.9, NUCLEUS_PIVOTS)
    e, masses, sums = exp_and_mass(x, x.amax(-1), shift, first_pass=(first, _ONE_BITS, plan[0]))
    assert sums.shape == (4, 3, 8) and sums.dtype == torch.float64
    target = (masses.sum(-1).double() * 0.9).ceil().to(torch.int64)
    skip = torch.tensor([0, 0, 0, 1], dtype=torch.int8, device=device)
    start = [torch.full((4,), first, device=device), torch.full((4,), _ONE_BITS, device=device)]
    start[0][3] = start[1][3] = 1 << 29  # a resolved row: width 1, skipped
    lo, hi = (t.clone() for t in start)
    screened_narrow(e, lo, hi, target, skip, shift, plan[0], sums=sums)
    want_lo, want_hi = (t.clone() for t in start)
    narrow(e, want_lo, want_hi, target, skip, shift, plan[0])
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi) and lo[3] == hi[3] == 1 << 29
    assert (hi - lo)[:3].max() < (_ONE_BITS - first) // 7


def test_the_screen_leaves_a_level_at_the_target_to_the_int64_sums():
    """Targets set at a level's exact mass, and one above it: float32 sums cannot tell reached from short
    there, so those rows take the int64 pass (settled 0), and land where the torch pass does."""
    device = needs_triton()
    from caspo.rollout.mass_above import screened_narrow

    vocab, m = 9000, NUCLEUS_PIVOTS
    x = random_logits(3, vocab, 1.0, seed=8).float()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift, first, _ = _nucleus_plan(vocab, 0.9, m)
    lo, hi = torch.full((3, 1), first), torch.full((3, 1), _ONE_BITS)
    cuts = lo + (hi - lo + 1) * torch.arange(1, m + 1) // (m + 1)
    masses = _masses(e, cuts.to(torch.int32).view(torch.float32), shift)  # [3, m]
    target = torch.stack([masses[0, 3], masses[1, 3] + 1, (masses[2, 3] + masses[2, 4]) // 2])[:, None]
    resolved = torch.zeros(3, 1, dtype=torch.bool)
    want_lo, want_hi = narrow_by_torch(e, lo, hi, target, resolved, shift, m)
    k_lo, k_hi = lo[:, 0].clone().to(device), hi[:, 0].clone().to(device)
    settled = screened_narrow(e.to(device), k_lo, k_hi, target[:, 0].to(device),
                              torch.zeros(3, dtype=torch.int8, device=device), shift, m)
    assert settled.tolist() == [0, 0, 1]  # the tie and the near miss to the int64 sums; the clear one screened
    assert torch.equal(k_lo.cpu(), want_lo[:, 0]) and torch.equal(k_hi.cpu(), want_hi[:, 0])
    assert want_hi[0, 0] - want_lo[0, 0] < (_ONE_BITS - first) // m  # narrowed, not left as it was


def kernel_logits(vocab: int = 9000) -> torch.Tensor:
    """Rows for the kernel path: flat (searched), peaked (resolved by the top chunks), top-k masked, a row
    resolved by its top chunks whose threshold ties with entries outside them, and one all tied."""
    x = random_logits(6, vocab, 2.0, seed=vocab).float()
    x[1] = x[1] * 20
    x[2] = x[2].masked_fill(x[2] < x[2].topk(300).values[-1], NEG_INF)
    x[3] = 0.0
    x[3, torch.arange(10) * 128 * 3] = 5.0  # ten 5s in ten chunks; at top_p 0.145 the 39th candidate (a 0) is t
    x[4] = 0.0
    return x


def test_nucleus_reads_equal_their_torch_definitions():
    """chunk_maxima, exp_and_mass and threshold_logit (triton's interpreter on the CPU) against torch."""
    device = needs_triton()
    from caspo.rollout.nucleus_reads import chunk_maxima, exp_and_mass, threshold_logit

    x = kernel_logits(9000).to(device)  # 9,000 = 70 chunks of 128 + 40: a partial chunk and a partial part
    maxima = chunk_maxima(x, 128)
    padded = torch.cat([x, x.new_full((6, 71 * 128 - 9000), NEG_INF)], -1)
    assert torch.equal(maxima, padded.view(6, 71, 128).amax(-1))
    shift = 62 - (9000 - 1).bit_length()
    e, masses = exp_and_mass(x, maxima.amax(-1), shift)
    torch.testing.assert_close(e, torch.exp(x - x.amax(-1, keepdim=True)), rtol=3e-7, atol=0)
    weight = (e * 2.0 ** shift).to(torch.int64)  # of the kernel's own e
    assert masses.shape == (6, 2) and torch.equal(masses, torch.stack([weight[:, :8192].sum(-1),
                                                                       weight[:, 8192:].sum(-1)], -1))
    t = e.gather(1, torch.randint(9000, (6, 1), generator=torch.Generator().manual_seed(0)).to(device))
    skip = torch.tensor([0, 0, 0, 0, 1, 0], dtype=torch.int8, device=device)
    got = threshold_logit(x, e, t[:, 0].view(torch.int32).to(torch.int64), skip)
    expected = torch.where(e >= t, x, float("inf")).amin(-1)
    assert torch.equal(got[skip == 0], expected[skip == 0]) and got[4] == float("inf")


@pytest.mark.parametrize("candidates, vocab, top_p", [
    (NUCLEUS_TOP, 9000, 0.145), (0, 9000, 0.9), (NUCLEUS_TOP, 5000, 0.9),
    pytest.param(NUCLEUS_TOP, 9000, 0.9, marks=pytest.mark.slow),
    pytest.param(0, 9000, 0.145, marks=pytest.mark.slow),
    pytest.param(NUCLEUS_TOP, 5000, 0.145, marks=pytest.mark.slow)])
def test_kernel_search_equals_the_torch_search(candidates, vocab, top_p):
    """The CUDA path of nucleus_threshold (its kernels in triton's interpreter) returns the torch path's
    threshold: the candidates' shortcut, its read-off threshold logit, the tie that forbids it, and the
    passes. (Exponentials may differ in their last bit across implementations; here they agree.)"""
    device = needs_triton()
    from caspo.rollout.nucleus_reads import chunk_maxima, exp_and_mass
    from caspo.rollout.nucleus_resolve import start_search
    from caspo.rollout.sampling import _nucleus_threshold_by_kernels

    x = kernel_logits(vocab)  # 5,000: 40 chunks, fewer than the candidates, all of them read
    got = _nucleus_threshold_by_kernels(x.to(device), top_p, candidates)[0].cpu()
    expected = nucleus_threshold(x, top_p, candidates=candidates)
    assert torch.equal(got, expected)
    scale = inverse_temperature(0.6)  # the kernels scale as they read: the threshold of a scaled copy
    scaled = _nucleus_threshold_by_kernels(x.to(device), top_p, candidates, scale)[0].cpu()
    assert torch.equal(scaled, nucleus_threshold(x * scale, top_p, candidates=candidates))
    assert torch.equal(nucleus_threshold(x, top_p, candidates=candidates, scale=scale), scaled)
    if candidates and top_p == 0.145 and vocab == 9000:
        shift, first, _ = _nucleus_plan(vocab, top_p, NUCLEUS_PIVOTS)
        xd = x.to(device)
        maxima = chunk_maxima(xd, 128)
        e, masses = exp_and_mass(xd, maxima.amax(-1), shift)
        target = (masses.sum(-1).double() * top_p).ceil().to(torch.int64)
        lo, hi, resolved, known, cut = (t.cpu() for t in start_search(
            xd, e, maxima, target, shift, first, _ONE_BITS, candidates, 128))
        assert resolved[1] and known[1] and cut[1] == got[1, 0]  # peaked: read off the top chunks
        assert resolved[3] and not known[3]  # t ties with zeros outside the top chunks: read from the row
        assert lo[3] == hi[3] == e[3, 1].cpu().view(torch.int32) and got[3, 0] == 0.0  # t = e of a 0
        assert resolved[4] and not known[4] and lo[4] == _ONE_BITS  # 9,000 ties at e = 1: 8,192 of them in the chunks


def test_collect_equals_its_torch_definition():
    """nucleus_reads.collect (triton's interpreter on the CPU): per part, the count of entries inside [lo, hi],
    `capacity` of them (distinct, in no set order), and its mass above hi, as torch computes them."""
    device = needs_triton()
    from caspo.rollout.nucleus_reads import SPAN, collect

    vocab, capacity = 9000, 32  # two parts, the second partial
    x = random_logits(4, vocab, 2.0, seed=3).float()
    x[3, 100:140] = 7.0  # forty ties inside one interval: more than a part can hold
    e = torch.exp(x - x.amax(-1, keepdim=True))
    shift = 62 - (vocab - 1).bit_length()
    ordered = e.sort(-1, descending=True).values
    lo = ordered[:, [30, 60, 500, 39]].diagonal()  # rows 0, 1: a few entries; row 2: hundreds; row 3: the ties
    hi = ordered[:, [5, 40, 20, 0]].diagonal()
    lo_bits, hi_bits = (v.view(torch.int32).to(torch.int64) for v in (lo, hi))
    skip = torch.tensor([0, 1, 0, 0], dtype=torch.int8)  # row 1 is resolved: not read
    values, index, counts, above = (t.cpu() for t in collect(
        e.to(device), lo_bits.to(device), hi_bits.to(device), skip.to(device), shift, capacity))
    inside = (e >= lo[:, None]) & (e <= hi[:, None])
    weight = (e * 2.0 ** shift).to(torch.int64)
    for row in (0, 2, 3):
        for part in range(2):
            span = slice(part * SPAN, (part + 1) * SPAN)
            assert above[row, part] == torch.where(e[row, span] > hi[row], weight[row, span], 0).sum()
        for part in range(2):
            members = inside[row, part * SPAN:(part + 1) * SPAN].nonzero()[:, 0] + part * SPAN
            assert counts[row, part] == len(members)
            kept = min(len(members), capacity)
            got = index[row, part, :kept].long()
            assert len(set(got.tolist())) == kept and set(got.tolist()) <= set(members.tolist())  # in no set order
            assert torch.equal(values[row, part, :kept], e[row, got])
    assert counts[2].max() > capacity and counts[3, 0] >= 40 and counts[0].max() <= capacity
    assert counts[1].eq(0).all() and above[1].eq(0).all()


@pytest.mark.parametrize("collect_after, capacity, top_p, candidates", [
    (0, 64, 0.9, 0), (2, 2, 0.9, NUCLEUS_TOP), (4, 64, 0.145, NUCLEUS_TOP),
    pytest.param(4, 64, 0.9, 0, marks=pytest.mark.slow),
    pytest.param(7, 8, 0.9, NUCLEUS_TOP, marks=pytest.mark.slow),
    pytest.param(99, 64, 0.9, NUCLEUS_TOP, marks=pytest.mark.slow)])
def test_rows_finished_from_their_gathered_interval_equal_the_passes(collect_after, capacity, top_p, candidates):
    """A row whose interval `collect` gathers whole after `collect_after` passes is finished by a sort of it,
    and the others search on: the torch path's threshold either way (99: never collected)."""
    device = needs_triton()
    from caspo.rollout.sampling import _nucleus_threshold_by_kernels

    x = kernel_logits(9000)
    x = torch.cat([x, random_logits(2, 9000, 0.5, seed=11)])  # flat rows: thousands of tokens in the nucleus
    scale = inverse_temperature(0.6) if collect_after == 4 else 1.0  # the kernels scale as they read
    got = _nucleus_threshold_by_kernels(x.to(device), top_p, candidates, scale,
                                        collect_after=collect_after, collect_capacity=capacity)[0].cpu()
    assert torch.equal(got, nucleus_threshold(x * scale, top_p, candidates=candidates))


@pytest.mark.parametrize("vocab", [9000, 20000])
def test_which_rows_the_gathered_interval_finishes(vocab):
    """After 4 passes the flat rows' intervals hold a few entries a part: gathered whole and finished in place,
    their threshold logit known; a capacity of one entry a part finishes none of them. (20,000: three parts,
    fewer than the kernel's power of two.)"""
    device = needs_triton()
    from caspo.rollout.mass_above import narrow
    from caspo.rollout.nucleus_reads import collect
    from caspo.rollout.nucleus_resolve import finish_search

    x = random_logits(3, vocab, 0.5, seed=11).float()
    shift, first, plan = _nucleus_plan(vocab, 0.9, NUCLEUS_PIVOTS)
    e = torch.exp(x - x.amax(-1, keepdim=True))
    target = (_masses(e, e.new_zeros(3, 1), shift).double() * 0.9).ceil().to(torch.int64)[:, 0]
    lo, hi = torch.full((3,), first), torch.full((3,), _ONE_BITS)
    skip = torch.tensor([0, 0, 1], dtype=torch.int8)  # row 2 stands for a row resolved earlier
    for m in plan[:4]:
        narrow(e, lo, hi, target, skip, shift, m)
    threshold = nucleus_threshold(x, 0.9)[:, 0]
    for capacity in (64, 1):
        state = [t.clone().to(device) for t in (x, e, target, lo, hi, skip)]
        known, cut = torch.zeros(3, dtype=torch.int8, device=device), torch.full((3,), 7.0, device=device)
        xd, ed, td, f_lo, f_hi, f_skip = state
        finish_search(xd, collect(ed, f_lo, f_hi, f_skip, shift, capacity), td, f_lo, f_hi, f_skip, known, cut,
                      shift)
        f_lo, f_hi, f_skip, known, cut = (t.cpu() for t in (f_lo, f_hi, f_skip, known, cut))
        if capacity == 1:
            assert known.eq(0).all() and torch.equal(f_skip, skip) and torch.equal(f_lo, lo) and cut.eq(7.0).all()
            continue
        assert known[:2].eq(1).all() and f_skip.eq(1).all() and torch.equal(f_lo[:2], f_hi[:2])
        assert torch.equal(cut[:2], threshold[:2])
        e_t = e[:2].gather(1, (x[:2] == threshold[:2, None]).float().argmax(-1, keepdim=True))[:, 0]
        assert torch.equal(f_lo[:2], e_t.view(torch.int32).to(torch.int64))  # lo = hi = t, the threshold's e
        assert known[2] == 0 and f_lo[2] == lo[2] and cut[2] == 7.0  # the skipped row is left as it was


# ---------------------------------------------------------------- GPU

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 151936


def cuda_batch(batch: int, std: float = 1.0, seed: int = 0):
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    logits = torch.randn(batch, VOCAB, device=CUDA, generator=generator) * std
    seeds = torch.arange(batch, device=CUDA) * 7919 + 17 + seed
    positions = (torch.arange(batch, device=CUDA) + seed) % 11
    return logits, seeds, positions


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 0.9)])
@pytest.mark.parametrize("std", [1.0, 8.0])
@pytest.mark.parametrize("batch", [1, 37, 256])
def test_fused_matches_eager_on_the_gpu(batch, std, top_k, top_p):
    logits, seeds, positions = cuda_batch(batch, std, seed=batch)
    fused = sample_next(logits, seeds, positions, 0.6, top_k, top_p)
    eager = sample_next(logits, seeds, positions, 0.6, top_k, top_p, fused=False)
    assert torch.equal(fused[0], eager[0])
    for got, expected in zip(fused[1:], eager[1:]):
        assert torch.allclose(got, expected, atol=1e-5)
    # the same code on the CPU: integer masses make the search independent of the device up to the
    # exponentials' last bits, which can only matter where the boundary is within ~1e-9 of top_p
    scaled = (logits / 0.6).cpu()
    on_gpu, on_cpu = cut_threshold(scaled.to(CUDA), top_k, top_p).cpu(), cut_threshold(scaled, top_k, top_p)
    differ = (on_gpu != on_cpu)[:, 0]
    masked = scaled.masked_fill(scaled < sorted_cut(scaled, top_k, 1.0), NEG_INF)  # what the nucleus sees
    assert (boundary_margin(masked[differ], top_p) < 1e-7).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 0.9), (0, 1.0)])
def test_fused_sampler_replays_in_a_cuda_graph(top_k, top_p):
    static = list(cuda_batch(64, seed=1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels before the capture
        for _ in range(3):
            sample_next(*static, 0.6, top_k, top_p)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_next(*static, 0.6, top_k, top_p)
    for seed in (2, 3):
        for buffer, value in zip(static, cuda_batch(64, std=1.0 + 3 * seed, seed=seed)):
            buffer.copy_(value)
        graph.replay()
        eager = sample_next(*static, 0.6, top_k, top_p, fused=False)
        assert torch.equal(out[0], eager[0])
        for got, expected in zip(out[1:], eager[1:]):
            assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("std", [1.0, 2.0])
def test_screened_passes_give_the_int64_search_on_the_gpu(std):
    """At a decode step's shape, rows whose nucleus holds thousands of tokens: the threshold with the first
    passes screened on float32 sums equals the one from int64 sums alone, bit for bit."""
    from caspo.rollout.sampling import _nucleus_threshold_by_kernels

    logits, _, _ = cuda_batch(256, std, seed=4)
    passes = len(_nucleus_plan(VOCAB, 0.9, NUCLEUS_PIVOTS)[2])
    scale = inverse_temperature(0.6)
    screened, _ = _nucleus_threshold_by_kernels(logits, 0.9, NUCLEUS_TOP, scale, screened_passes=passes)
    exact, _ = _nucleus_threshold_by_kernels(logits, 0.9, NUCLEUS_TOP, scale, screened_passes=0)
    assert torch.equal(screened, exact)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("std", [1.0, 8.0])
def test_kernel_search_equals_the_torch_search_on_the_gpu(std):
    """At a decode step's shape, the kernels' threshold equals the torch search's over the same exponentials, bit
    for bit (the CPU comparison above allows the exponentials' last bits; this one allows nothing, so it sees a
    target off by a float32 top_p, ~2e-8 of the mass, in a row or two of 256)."""
    from caspo.rollout.nucleus_reads import chunk_maxima, exp_and_mass
    from caspo.rollout.sampling import _nucleus_threshold_by_kernels

    logits, _, _ = cuda_batch(256, std, seed=5)
    shift, first, plan = _nucleus_plan(VOCAB, 0.9, NUCLEUS_PIVOTS)
    scale = inverse_temperature(0.6)
    got, _ = _nucleus_threshold_by_kernels(logits, 0.9, NUCLEUS_TOP, scale)
    x = logits * scale
    e, _ = exp_and_mass(logits, chunk_maxima(logits, 128, scale).amax(-1), shift, scale)
    weight = (e * 2.0 ** shift).to(torch.int64)
    target = (weight.sum(-1, keepdim=True).double() * 0.9).ceil().to(torch.int64)
    found, resolved = _threshold_among_top(e, target, shift, NUCLEUS_TOP)
    lo, hi = torch.where(resolved, found, first), torch.where(resolved, found, _ONE_BITS)
    for m in plan:
        lo, hi = narrow_by_torch(e, lo, hi, target, resolved, shift, m, weight)
    expected = torch.where(e >= lo.to(torch.int32).view(torch.float32), x, float("inf")).amin(-1, keepdim=True)
    assert torch.equal(got, expected)
