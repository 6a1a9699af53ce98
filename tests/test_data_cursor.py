import json

import pytest
import torch

from caspo.data import PromptCursor
from caspo.data.cursor import pass_seed


def test_pinned_permutation():
    # The stream must not depend on the process or platform; a change here breaks resumed runs.
    assert PromptCursor(10, seed=0).take(10) == [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
    assert pass_seed(0, 0) == 0 and pass_seed(0, 1) == 3336512721778491498


def test_run_seeds_walk_different_passes():
    """Replicates of an experiment (train.seed 0, 1, ...) share no pass order, at any pair of epochs."""
    passes = {(seed, epoch): PromptCursor(50, seed).permutation(epoch) for seed in range(4) for epoch in range(6)}
    for (seed, epoch), order in passes.items():
        for (other_seed, other_epoch), other in passes.items():
            if seed != other_seed:
                assert order != other, f"seed {seed} epoch {epoch} == seed {other_seed} epoch {other_epoch}"
    assert all(PromptCursor(50, seed).permutation(epoch) == order for (seed, epoch), order in passes.items())


def test_each_pass_is_a_fresh_permutation():
    cursor = PromptCursor(50, seed=3)
    passes = [cursor.take(50) for _ in range(3)]
    assert all(sorted(p) == list(range(50)) for p in passes)
    assert passes[0] != passes[1] != passes[2]
    assert passes == [cursor.permutation(e) for e in range(3)]
    assert cursor.epoch == 3


def test_takes_cross_pass_boundaries():
    cursor = PromptCursor(10, seed=1)
    taken = [cursor.take(7) for _ in range(6)]
    assert [len(t) for t in taken] == [7] * 6
    stream = sum(taken, [])
    assert stream == sum((cursor.permutation(e) for e in range(5)), [])[:42]
    assert cursor.epoch == 4 and cursor.position == 2
    assert cursor.take(0) == []


def test_epoch_counts_completed_passes():
    cursor = PromptCursor(4, seed=0)
    cursor.take(3)
    assert cursor.epoch == 0
    cursor.take(1)
    assert cursor.epoch == 1 and cursor.position == 0


def test_same_seed_same_stream_and_seeds_differ():
    assert PromptCursor(100, 5).take(250) == PromptCursor(100, 5).take(250)
    assert PromptCursor(100, 5).take(100) != PromptCursor(100, 6).take(100)


@pytest.mark.parametrize("k", [0, 5, 13, 20, 37])
def test_resume_continues_exactly(k):
    uninterrupted = PromptCursor(13, seed=9).take(80)
    cursor = PromptCursor(13, seed=9)
    head = cursor.take(k)
    state = json.loads(json.dumps(cursor.state_dict()))  # survives a checkpoint round trip
    assert state["epoch"] == cursor.epoch and state["position"] == cursor.position
    resumed = PromptCursor(13, seed=9)
    resumed.load_state_dict(state)
    assert head + resumed.take(80 - k) == uninterrupted


def test_state_from_other_dataset_is_rejected():
    state = PromptCursor(13, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_items"):
        PromptCursor(14, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptCursor(13, seed=1).load_state_dict(state)


def test_empty_dataset():
    with pytest.raises(ValueError, match="num_items=0: the dataset is empty"):
        PromptCursor(0, seed=0)


def test_a_checkpoint_from_before_the_hashed_seeds_resumes_its_own_stream():
    """Its state names no order: the stream goes on with seed + epoch, the order it began in."""
    state = {"epoch": 2, "position": 3, "num_items": 10, "seed": 4}
    cursor = PromptCursor(10, seed=4)
    cursor.load_state_dict(state)
    summed = [torch.randperm(10, generator=torch.Generator().manual_seed(4 + e)).tolist() for e in (2, 3)]
    assert cursor.take(12) == summed[0][3:] + summed[1][:5]
    assert cursor.state_dict()["order"] == "seed+epoch"  # and its checkpoints say so
    assert PromptCursor(10, seed=4).state_dict()["order"] == "hashed"
