"""Decode attention with shared prefixes read once per group, against decode_attention and a float64 reference;
on CPU through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1)."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from test_decode_attention import DEVICE, reference  # noqa: E402

import caspo.rollout.native.shared_prefix_attention as spa  # noqa: E402
from caspo.rollout.native.decode_attention import decode_attention  # noqa: E402
from caspo.rollout.native.prefix_groups import PrefixGroups, group_rows, members_per_group  # noqa: E402
from caspo.rollout.native.shared_prefix_attention import shared_prefix_decode_attention  # noqa: E402


def tensor(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def groups_of(rows_per_group, slots, prefix, batch, capacity, members):
    """PrefixGroups with `capacity` group entries and `members` columns; the entries past the groups in use
    hold garbage, which the kernel must never read."""
    table = torch.full((capacity, members), 10**6, dtype=torch.int64)
    group_slots, lengths, starts = [10**6] * capacity, [10**6] * capacity, [0] * batch
    for g, (rows, length) in enumerate(zip(rows_per_group, prefix)):
        table[g, :len(rows)] = torch.tensor(rows)
        group_slots[g], lengths[g] = slots[rows[-1]], length  # any member's slot holds the prefix
        for row in rows:
            starts[row] = length
        table[g, len(rows):] = -1
    return PrefixGroups(table.to(DEVICE), tensor(group_slots), tensor(lengths), tensor(starts),
                        tensor([len(rows_per_group)]))


def shared_cache(B, Hkv, L, D, groups, prefix, seed=0, dtype=torch.float32):
    """k, v [B + 3, Hkv, L, D] as views of the engine's layout, each group's slots holding one copy of its prefix."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, 2, B + 3, Hkv, L, D, generator=g).to(dtype)
    k, v = kv[1, 0, 0], kv[1, 0, 1]
    for rows, length in zip(groups, prefix):
        for row in rows[1:]:  # slot b + 2 holds row b (slots are not rows)
            k[row + 2, :, :length] = k[rows[0] + 2, :, :length]
            v[row + 2, :, :length] = v[rows[0] + 2, :, :length]
    kv = kv.to(DEVICE)
    return kv[1, 0, 0], kv[1, 0, 1]


@pytest.mark.parametrize("H, Hkv", [(4, 2), (6, 1), (4, 4)])
def test_matches_decode_attention_and_the_reference(H, Hkv):
    B, L, D, key_len = 7, 200, 16, 190
    groups, prefix = [[0, 2, 5], [1, 6]], [70, 129]  # rows 3 and 4 in no group
    lengths = tensor([150, 190, 71, 33, 1, 100, 130])
    slots = torch.arange(B, device=DEVICE) + 2
    k, v = shared_cache(B, Hkv, L, D, groups, prefix)
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grouped = groups_of(groups, slots.tolist(), prefix, B, capacity=4, members=members_per_group(H, Hkv))
    out = shared_prefix_decode_attention(q, k, v, lengths, key_len, slots, grouped)
    plain = decode_attention(q, k, v, lengths, key_len, slots)
    expected = reference(q, k[2:], v[2:], lengths, key_len)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert torch.allclose(out, plain, atol=1e-5)


def test_a_group_reads_only_its_chosen_slots_prefix():
    """The prefix keys come from the group's slot alone: poisoning the members' own copies changes nothing, and
    poisoning the group's slot changes every member."""
    B, H, Hkv, L, D = 4, 4, 2, 64, 16
    groups, prefix = [[0, 1, 3]], [40]
    lengths, slots = tensor([50, 60, 45, 64]), torch.arange(B, device=DEVICE) + 2
    k, v = shared_cache(B, Hkv, L, D, groups, prefix)
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grouped = groups_of(groups, slots.tolist(), prefix, B, capacity=2, members=8)
    before = shared_prefix_decode_attention(q, k, v, lengths, 64, slots, grouped)
    chosen = int(grouped.slots[0])
    for slot in (2, 3):  # rows 0 and 1: not the chosen slot (row 3's)
        k[slot, :, :40] = 1e4
    assert torch.equal(shared_prefix_decode_attention(q, k, v, lengths, 64, slots, grouped), before)
    v[chosen, :, :40] += 1.0
    after = shared_prefix_decode_attention(q, k, v, lengths, 64, slots, grouped)
    assert all(not torch.allclose(after[row], before[row]) for row in (0, 1, 3))
    assert torch.equal(after[2], before[2])  # row 2 is in no group


def test_group_rows():
    keys = [(7, 30), None, (7, 30), (9, 12), (7, 30), (7, 30), (9, 12), (5, 8)]
    groups = [-1 if key is None else key[0] for key in keys]
    lengths = [0 if key is None else key[1] for key in keys]
    table, starts = group_rows(groups, lengths, members=3)
    # row 5 would be alone in a second (7, 30) group; (5, 8) has one row
    assert sorted(map(list, table)) == [[0, 2, 4], [3, 6, -1]]
    assert starts.tolist() == [30, 0, 30, 12, 30, 0, 12, 0]
    table, starts = group_rows([-1, -1], [0, 0], members=4)
    assert table.shape == (0, 4) and starts.tolist() == [0, 0]
    # one prompt group with two prompt lengths is two keys; eight rows of one key in groups of three: 3 + 3 + 2
    table, _ = group_rows([4, 4, 4, 4, 4, 4, 4, 4, 4, 4], [9, 9, 9, 9, 9, 9, 9, 9, 5, 5], members=3)
    assert sorted(map(list, table)) == [[0, 1, 2], [3, 4, 5], [6, 7, -1], [8, 9, -1]]
    assert members_per_group(12, 2) == 10 and members_per_group(32, 8) == 16


def test_a_step_is_grouped_only_where_the_reads_saved_pay(monkeypatch):
    from caspo.rollout.native import prefix_groups
    from caspo.rollout.native.prefix_groups import keys_saved, worth_grouping

    # groups [0, 2, 4] of P = 30 and [3, 6] of P = 12: 2 × 30 + 1 × 12 keys a layer not read
    table, starts = group_rows([7, -1, 7, 9, 7, 7, 9, 5], [30, 0, 30, 12, 30, 30, 12, 8], members=3)
    assert keys_saved(table, starts) == 72
    assert keys_saved(*group_rows([-1, -1], [0, 0], members=4)) == 0
    monkeypatch.setattr(prefix_groups, "MIN_BYTES_SAVED", 0)  # whatever the threshold, no group: not grouped
    assert not worth_grouping(*group_rows([-1, 3], [0, 5], members=4), bytes_per_key=1)
    assert worth_grouping(table, starts, bytes_per_key=1)
    monkeypatch.undo()
    qwen_1_5b = 2 * 2 * 128 * 2  # bytes a key of one layer: K and V of 2 KV heads of 128, bf16
    # a Monte Carlo step: 960 rows, K = 9 continuations of prefixes of 300 keys, 106 groups of 9 and one of 6:
    # (106 × 8 + 5) × 300 keys saved, 250 MiB a layer
    table, starts = group_rows(np.arange(960) // 9, np.full(960, 300), members_per_group(12, 2))
    assert keys_saved(table, starts) == (106 * 8 + 5) * 300 and worth_grouping(table, starts, qwen_1_5b)
    # a rollout step of 32 prompts × G = 8: 32 × 7 × P keys, 28 MiB at P = 128 (slower grouped), 112 at 512
    for prompt, pays in ((128, False), (512, True)):
        table, starts = group_rows(np.arange(256) // 8, np.full(256, prompt), members_per_group(12, 2))
        assert keys_saved(table, starts) == 32 * 7 * prompt and worth_grouping(table, starts, qwen_1_5b) == pays


@pytest.mark.parametrize("prefix_chunk, block_n", [(None, 32), (100, 64), pytest.param(64, 32, marks=pytest.mark.slow),
                                                   pytest.param(100, 32, marks=pytest.mark.slow)])
def test_many_groups_of_long_and_short_prefixes(prefix_chunk, block_n, monkeypatch):
    """Seven groups, prefixes of 1 to 600 keys over several blocks, rows in none, garbage entries past the groups
    in use, prefix programs of the default or a forced number of keys, walked in blocks of 32 or 64 keys: the same
    attention as decode_attention and the reference."""
    monkeypatch.setattr(spa, "PREFIX_BLOCK_N", block_n)
    B, H, Hkv, L, D, key_len = 24, 4, 2, 700, 16, 700
    groups = [[3 * g, 3 * g + 1, 3 * g + 2] for g in range(6)] + [[18, 20]]  # rows 19, 21..23 in none
    prefix = [40, 300, 513, 256, 257, 1] + [600]
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([p for p in prefix[:6] for _ in range(3)] + [601, 90, 650, 700, 5, 333])
    lengths[:18] += torch.randint(1, 100, (18,), generator=g)  # the six groups of three: past their prefix
    lengths = lengths.clamp(max=key_len).to(DEVICE)
    slots = torch.arange(B, device=DEVICE) + 2
    k, v = shared_cache(B, Hkv, L, D, groups, prefix, seed=4)
    q = torch.randn(B, H, D, generator=g).to(DEVICE)
    grouped = groups_of(groups, slots.tolist(), prefix, B, capacity=12, members=members_per_group(H, Hkv))
    out = shared_prefix_decode_attention(q, k, v, lengths, key_len, slots, grouped, prefix_chunk=prefix_chunk)
    assert torch.allclose(out, decode_attention(q, k, v, lengths, key_len, slots), atol=1e-5)
    assert torch.allclose(out.double(), reference(q, k[2:], v[2:], lengths, key_len), atol=1e-5)


def test_rejects_groups_that_do_not_fit():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    k = v = torch.zeros(2, 2, 8, 16, device=DEVICE)
    too_wide = PrefixGroups(torch.full((1, 40), -1, dtype=torch.int64, device=DEVICE), tensor([0]), tensor([0]),
                            tensor([0, 0]), tensor([0]))
    with pytest.raises(ValueError, match="at most 32 a group"):
        shared_prefix_decode_attention(q, k, v, tensor([1, 1]), 8, tensor([0, 1]), too_wide)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_at_the_real_shape_matches_decode_attention():
    """Qwen2.5-1.5B's decode shape (12 heads, 2 KV heads, D = 128), 90 rows in groups of 9 with prefixes of 300
    keys, in bf16: as close to decode_attention as two summation orders of bf16 inputs are."""
    B, H, Hkv, L, D, key_len = 90, 12, 2, 640, 128, 640
    groups = [list(range(g, g + 9)) for g in range(0, 81, 9)]  # rows 81..89 in no group
    prefix = [300] * len(groups)
    k, v = shared_cache(B, Hkv, L, D, groups, prefix, dtype=torch.bfloat16)
    lengths = torch.randint(301, key_len + 1, (B,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    slots = torch.arange(B, device=DEVICE) + 2
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    grouped = groups_of(groups, slots.tolist(), prefix, B, capacity=B // 2 + 1, members=members_per_group(H, Hkv))
    out = shared_prefix_decode_attention(q, k, v, lengths, key_len, slots, grouped)
    plain = decode_attention(q, k, v, lengths, key_len, slots)
    diff = (out.float() - plain.float()).abs()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert diff.mean().item() <= 1e-3 and diff.max().item() <= 2e-2, (diff.mean().item(), diff.max().item())
