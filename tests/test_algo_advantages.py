import math

import pytest
import torch

from caspo.algo import gae, group_advantages, step_td, terminal_advantages
from caspo.algo.advantages import _discounted_suffix_sums, scoped_whiten

NAN, INF = float("nan"), float("inf")


def gae_by_hand(rewards, values, mask, gamma, lam):
    """The verl loop on Python lists, one row at a time."""
    adv_rows = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        nv = g = 0.0
        out = [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                delta = r_row[t] + gamma * nv - v_row[t]
                g = delta + gamma * lam * g
                nv = v_row[t]
                out[t] = g
        adv_rows.append(out)
    return adv_rows


def test_gae_with_a_hole_by_hand():
    rewards = torch.tensor([[0.0, 9.0, 0.0, 1.0], [1.0, NAN, INF, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, NAN, 0.6, 0.8], [0.3, INF, NAN, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0, γλ = 0.45:
    #   t=3: δ = 1 + 0 − 0.8 = 0.2                       A = 0.2,   nv = 0.8
    #   t=2: δ = 0 + 0.9·0.8 − 0.6 = 0.12                A = 0.12 + 0.45·0.2 = 0.21,  nv = 0.6
    #   t=1: hole, skipped (its reward 9 is ignored)
    #   t=0: δ = 0 + 0.9·0.6 − 0.5 = 0.04                A = 0.04 + 0.45·0.21 = 0.1345
    # row 1: only t=0: δ = 1 − 0.3 = 0.7
    expected_adv = torch.tensor([[0.1345, 0.0, 0.21, 0.2], [0.7, 0.0, 0.0, 0.0]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.6345, 0.0, 0.81, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


# 9 tokens: one block; 600: three blocks of GAE_BLOCK = 256 chained. Holes, an empty row, a row ending early.
@pytest.mark.parametrize("T, gamma, lam", [(9, 0.95, 0.8), (600, 0.99, 0.95)])
def test_gae_matches_hand_loop_on_random_ragged_batch_with_holes(T, gamma, lam):
    gen = torch.Generator().manual_seed(T)
    B = 5
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.3).long()
    mask[2] = 0  # an empty row
    mask[3, T // 2:] = 0
    expected = gae_by_hand(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.where(mask.bool(), adv + values, 0.0))


@pytest.mark.parametrize("block", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_discounted_suffix_sums_against_a_loop(block, discount):
    x = torch.randn(2, 13, generator=torch.Generator().manual_seed(block), dtype=torch.float64)
    expected = torch.zeros_like(x)
    running = torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(13)):
        running = x[:, t] + discount * running
        expected[:, t] = running
    torch.testing.assert_close(_discounted_suffix_sums(x, discount, block), expected)


def test_gae_of_no_rows_or_no_tokens():
    for shape in ((0, 5), (3, 0)):
        adv, ret = gae(torch.zeros(shape), torch.zeros(shape), torch.ones(shape), 1.0, 0.9)
        assert adv.shape == ret.shape == shape


def test_gae_gamma_lambda_one_value_zero_is_return_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0, NAN], [0.0, 0.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv, ret = gae(rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    # row 0: 1+2+3, 2+3, 3; row 1: the terminal 5 reaches back to t=0
    expected = torch.tensor([[6.0, 5.0, 3.0, 0.0], [5.0, 5.0, 5.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_gae_has_no_gradient():
    values = torch.zeros(1, 3, requires_grad=True)
    adv, ret = gae(torch.ones(1, 3), values, torch.ones(1, 3), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_group_advantages_by_hand_with_arbitrary_labels():
    # groups interleaved, labels 5, 9, -1
    scores = torch.tensor([1.0, 2.0, 0.3, 0.0, 2.0, 1.0, 0.7, 0.5, 2.0], dtype=torch.float64)
    ids = torch.tensor([5, 9, -1, 5, 9, 5, -1, 5, 9])
    adv = group_advantages(scores, ids)
    # group 5 = [1, 0, 1, 0.5]: mean 0.625, deviations .375 −.625 .375 −.125,
    #   Σd² = .140625 + .390625 + .140625 + .015625 = .6875, unbiased var = .6875/3
    s5 = math.sqrt(0.6875 / 3) + 1e-6
    # group -1 = [0.3, 0.7]: mean 0.5, d = ∓0.2, var = 0.08/1
    s1 = math.sqrt(0.08) + 1e-6
    expected = torch.tensor(
        [0.375 / s5, 0.0, -0.2 / s1, -0.625 / s5, 0.0, 0.375 / s5, 0.2 / s1, -0.125 / s5, 0.0], dtype=torch.float64
    )
    torch.testing.assert_close(adv, expected)

    centered = group_advantages(scores, ids, std_normalize=False)
    expected = torch.tensor([0.375, 0.0, -0.2, -0.625, 0.0, 0.375, 0.2, -0.125, 0.0], dtype=torch.float64)
    torch.testing.assert_close(centered, expected)


def test_group_advantages_equal_scores_give_exact_zero():
    # in fp64 the mean of three 0.1s is 0.1 − 1.4e-17, so s − mean alone would not be 0
    scores = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(scores, torch.tensor([3, 3, 3, 4, 4]))
    assert (adv[:3] == 0).all()
    assert adv[3].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))


def test_group_advantages_singleton_is_an_error_naming_the_group():
    with pytest.raises(ValueError, match="42"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([7, 7, 42]))


def test_terminal_advantages_scopes():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ids = torch.tensor([0, 0, 1, 1])
    # batch: mean 0.5, d = ±0.5, unbiased var = 4·0.25/3 = 1/3
    s = math.sqrt(1 / 3) + 1e-6
    torch.testing.assert_close(terminal_advantages(scores, ids, "batch"), torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    # group: each pair is {0, 1}: d = ±0.5, var = 0.5
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(terminal_advantages(scores, ids, "group"), torch.tensor([g, -g, -g, g]))
    torch.testing.assert_close(terminal_advantages(scores, None, "off"), scores)
    assert (terminal_advantages(torch.ones(4), None, "batch") == 0).all()
    with pytest.raises(ValueError, match="batch"):
        terminal_advantages(scores, ids, "prompt")
    # std_normalize=False (Dr. GRPO's centring): s − mean, of the batch and of each group
    uneven = torch.tensor([3.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(terminal_advantages(uneven, ids, "batch", std_normalize=False),
                               torch.tensor([2.0, -1.0, -1.0, 0.0]))
    torch.testing.assert_close(terminal_advantages(uneven, ids, "group", std_normalize=False),
                               torch.tensor([1.5, -1.5, -0.5, 0.5]))


def test_step_td_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, NAN], [0.0, 1.0, INF, NAN]])
    values = torch.tensor([[0.5, 0.7, 0.9, 3.0], [0.2, 0.4, NAN, INF]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # γ = 1, V after the last valid step = 0:
    #   row 0: 0 + .7 − .5 = .2,  0 + .9 − .7 = .2,  1 + 0 − .9 = .1
    #   row 1: 0 + .4 − .2 = .2,  1 + 0 − .4 = .6
    expected = torch.tensor([[0.2, 0.2, 0.1, 0.0], [0.2, 0.6, 0.0, 0.0]])
    torch.testing.assert_close(step_td(rewards, values, mask), expected)
    # γ = 0.5, row 0: .35 − .5 = −.15,  .45 − .7 = −.25,  1 − .9 = .1
    half = step_td(rewards, values, mask, gamma=0.5)
    torch.testing.assert_close(half[0], torch.tensor([-0.15, -0.25, 0.1, 0.0]))


def test_scoped_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, NAN], [5.0, INF, 0.0, 0.0], [0.0, 4.0, 9.0, 9.0], [2.0, 2.0, 9.0, 9.0]],
                     dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    groups = torch.tensor([4, 4, -2, -2])
    # group 4 = {1, 2, 3, 5}: mean 2.75, d = −1.75 −.75 .25 2.25, Σd² = 8.75, var = 8.75/3
    # group −2 = {0, 4, 2, 2}: mean 2, d = −2 2 0 0, Σd² = 8, var = 8/3
    s4, s2 = math.sqrt(8.75 / 3 + 1e-8), math.sqrt(8 / 3 + 1e-8)
    expected = torch.tensor([[-1.75 / s4, -0.75 / s4, 0.25 / s4, 0.0], [2.25 / s4, 0.0, 0.0, 0.0],
                             [-2 / s2, 2 / s2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(scoped_whiten(x, mask, groups, "group"), expected)
    # batch: all eight entries, sum 19, mean 2.375; Σd² = Σx² − 8·mean² = 63 − 45.125 = 17.875, var = 17.875/7
    sb = math.sqrt(17.875 / 7 + 1e-8)
    batch = scoped_whiten(x, mask, groups, "batch")
    torch.testing.assert_close(batch[0, :3], (torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) - 2.375) / sb)
    torch.testing.assert_close(batch[2, :2], (torch.tensor([0.0, 4.0], dtype=torch.float64) - 2.375) / sb)
    off = scoped_whiten(x, mask, groups, "off")
    torch.testing.assert_close(off, torch.where(mask.bool(), x, 0.0))  # untouched, padding zeroed
    with pytest.raises(ValueError, match="batch, group, off"):
        scoped_whiten(x, mask, groups, "prompt")


def test_scoped_whiten_flat_and_single_entry_groups_are_exactly_zero():
    x = torch.tensor([[0.1, 0.1, 0.1], [0.1, 0.1, 7.0], [3.0, 0.0, 0.0], [1.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])
    out = scoped_whiten(x, mask, torch.tensor([0, 0, 1, 2]), "group")
    assert (out[:3] == 0).all()  # group 0: five equal entries; group 1: one entry
    torch.testing.assert_close(out[3, :2], torch.tensor([-0.5, 0.5]) / math.sqrt(0.5 + 1e-8))


def test_scoped_whiten_flat_or_single_entry_batch_is_exactly_zero():
    flat = torch.tensor([[0.1, 0.1, 0.1], [0.1, 0.1, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    groups = torch.tensor([0, 1])
    assert (scoped_whiten(flat, mask, groups, "batch") == 0).all()  # not the rounding residue over sqrt(eps)
    one = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    assert (scoped_whiten(one, torch.tensor([[0, 0], [1, 0]]), groups, "batch") == 0).all()  # σ² = 0, as a group


def test_clip_sigmas_and_minibatch_whitening_of_one_entry():
    from caspo.train.advantages import clip_sigmas, minibatch_advantages

    adv, mask = torch.tensor([[5.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    assert torch.equal(clip_sigmas(adv, mask, 1.0, whitened=False), adv)  # no spread to clip against
    out = minibatch_advantages(torch.tensor([[5.0], [2.0]]), torch.tensor([[1.0], [1.0]]), torch.tensor([0]), 3.0)
    assert out.tolist() == [[0.0], [2.0]]  # a minibatch of one token has no signal; the other row is untouched


def test_scoped_whiten_one_group_is_the_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 7, generator=g) > 0.3).long()
    same = torch.full((6,), 9)
    torch.testing.assert_close(scoped_whiten(x, mask, same, "group"), scoped_whiten(x, mask, same, "batch"))
