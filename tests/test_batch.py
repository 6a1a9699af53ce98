"""RolloutBatch.select and micro_batches: every per-sample field follows its rows, frames are trimmed."""

import pytest
import torch

from caspo.batch import RolloutBatch, plan_micro_batches
from caspo.rollout.base import Completion


def make_batch() -> RolloutBatch:
    completions = [Completion([5, 6, 7], [-0.1, -0.2, -0.3], "stop", 0), Completion([8], [-0.4], "length", 0),
                   Completion([9, 10], [-0.5, -0.6], "stop", 1)]
    batch = RolloutBatch.from_completions([[1, 2], [3], [4, 4, 4]], completions, group_ids=[0, 0, 1],
                                          example_ids=["a", "a", "b"], sample_seeds=[11, 12, 13],
                                          texts=["x", "y", "z"], pad_token_id=0, labels=["3", "3", "7"])
    batch.rewards = torch.tensor([1.0, 0.0, 1.0])
    batch.step_ids = torch.tensor([[0, 0, 1], [0, -1, -1], [0, 1, -1]])
    batch.step_values = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0], [0.4, 0.5, 0.0, 0.0]])
    batch.step_mask = (batch.step_values != 0).float()
    batch.stats["reward_timeouts"] = 2
    return batch


def test_select_slices_every_per_sample_field_and_trims_the_response_frame():
    batch = make_batch()
    micro = batch.select([1, 2])
    assert micro.labels == ["3", "7"] and micro.prompt_ids == [[3], [4, 4, 4]] and micro.texts == ["y", "z"]
    assert micro.sample_seeds == [12, 13] and micro.example_ids == ["a", "b"] and micro.policy_versions == [0, 1]
    assert torch.equal(micro.rewards, torch.tensor([0.0, 1.0]))
    R = 2  # the longest selected response
    assert micro.responses.shape == (2, R) and micro.step_ids.shape == (2, R)
    assert micro.input_ids.shape == (2, batch.prompt_width + R)
    assert torch.equal(micro.step_ids, torch.tensor([[0, -1], [0, 1]]))
    # step tensors are [B, S]: rows follow, the step axis is not the response frame and stays whole
    assert torch.equal(micro.step_values, batch.step_values[[1, 2]])
    assert micro.stats == {"reward_timeouts": 2} and micro.stats is not batch.stats  # batch-level, copied


def test_micro_batches_cover_the_rows_in_order():
    batch = make_batch()
    rows = torch.tensor([2, 0, 1])
    chunks = list(batch.micro_batches(2, rows))
    assert [idx.tolist() for idx, _ in chunks] == [[2, 0], [1]]
    assert [micro.labels for _, micro in chunks] == [["7", "3"], ["3"]]
    assert [idx.tolist() for idx, _ in batch.micro_batches(2)] == [[0, 1], [2]]


def test_select_trims_the_prompt_frame_to_the_longest_selected_prompt():
    batch = make_batch()  # prompts of 2, 1 and 3 tokens, left-padded to 3
    micro = batch.select([0, 1])
    assert micro.prompt_width == 2 and micro.input_ids.shape == (2, 2 + 3)
    assert micro.input_ids.tolist() == [[1, 2, 5, 6, 7], [0, 3, 8, 0, 0]]
    # the response columns are where the trimmed frame says they are
    assert torch.equal(micro.input_ids[:, micro.prompt_width:], micro.responses)
    assert torch.equal(micro.position_ids, batch.position_ids[[0, 1], 1:])


def test_token_budget_packs_rows_by_length_within_the_budget():
    batch = make_batch()  # row lengths (prompt + response): 5, 2, 5
    chunks = list(batch.micro_batches(8, max_tokens=10))
    assert sorted(i for idx, _ in chunks for i in idx.tolist()) == [0, 1, 2]  # every row once
    for idx, micro in chunks:
        assert micro.input_ids.numel() <= 10 or len(idx) == 1
    # longest first; rows 0 and 2 together would be 2 × (3 + 3) = 12, rows 2 and 1 fit: 2 × (3 + 2) = 10
    assert [idx.tolist() for idx, _ in chunks] == [[0], [2, 1]]
    # the row cap still holds, and a row over the budget goes alone
    assert [len(idx) for idx, _ in batch.micro_batches(1, max_tokens=100)] == [1, 1, 1]
    assert [len(idx) for idx, _ in batch.micro_batches(8, max_tokens=3)] == [1, 1, 1]


@pytest.mark.parametrize("max_tokens", [0, 10])
def test_micro_batches_read_lengths_once_and_give_what_select_gives(max_tokens, monkeypatch):
    """The frame each micro-batch gets from the lengths read up front is the one select reads itself."""
    batch = make_batch()
    chunks = list(batch.micro_batches(2, torch.tensor([2, 0, 1]), max_tokens))
    for idx, micro in chunks:
        alone = batch.select(idx)
        assert micro.prompt_width == alone.prompt_width and torch.equal(micro.input_ids, alone.input_ids)
        assert torch.equal(micro.responses, alone.responses)
    reads = []  # int(tensor): a host read of a device value, which waits for the queued kernels
    original = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: reads.append(1) or original(self))
    list(batch.micro_batches(2, torch.tensor([2, 0, 1]), max_tokens))
    assert reads == []  # select was given each frame: no per-micro-batch read of the lengths


def test_a_last_micro_batch_of_one_row_takes_a_row_from_the_one_before():
    # a compiled block builds a graph of its own for one row: the split avoids one where it can
    assert plan_micro_batches([1] * 9, [1] * 9, 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8]]
    assert plan_micro_batches([1] * 5, [1] * 5, 2) == [[0, 1], [2, 3], [4]]  # the one before would keep one
    assert plan_micro_batches([1] * 4, [1] * 4, 1) == [[0], [1], [2], [3]]
    # packed: frames of 5, 4, 4, 3 tokens (prompt 1 + response) in a budget of 12: [0, 1] and [2, 3] fit, as
    # [0, 1, 2] would not (3 × 5); a budget of 15 packs three rows, leaving row 3 alone: it takes row 2
    responses = [4, 3, 3, 2]
    assert plan_micro_batches([1] * 4, responses, 8, max_tokens=12) == [[0, 1], [2, 3]]
    assert plan_micro_batches([1] * 4, responses, 8, max_tokens=15) == [[0, 1], [2, 3]]
    # rows of frames 5, 5, 5 and one whose long prompt makes a pair with row 2 wider than the budget
    assert plan_micro_batches([1, 1, 1, 4], [4, 4, 4, 0], 8, max_tokens=15) == [[0, 1, 2], [3]]


def test_the_split_keeps_every_row_once_within_its_bounds():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        count = int(torch.randint(1, 40, (1,), generator=gen))
        prompts = torch.randint(1, 20, (count,), generator=gen).tolist()
        responses = torch.randint(0, 60, (count,), generator=gen).tolist()
        size = int(torch.randint(1, 9, (1,), generator=gen))
        budget = int(torch.randint(0, 400, (1,), generator=gen)) if trial % 2 else 0
        chunks = plan_micro_batches(prompts, responses, size, budget)
        assert sorted(i for chunk in chunks for i in chunk) == list(range(count))
        for chunk in chunks:
            frame = max(prompts[i] for i in chunk) + max(responses[i] for i in chunk)
            assert len(chunk) <= size and (len(chunk) == 1 or not budget or len(chunk) * frame <= budget)
        if not budget:
            assert [i for chunk in chunks for i in chunk] == list(range(count))  # consecutive, in order
        if len(chunks) > 1 and len(chunks[-1]) == 1 and len(chunks[-2]) > 2 and size > 1:
            pair = [chunks[-2][-1], chunks[-1][0]]  # left alone only where the pair would not fit
            assert budget and 2 * (max(prompts[i] for i in pair) + max(responses[i] for i in pair)) > budget
