"""Tests for roll_core/data/loader.py: epoch order, drop_last and exact resume."""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from roll_core.data import StatefulLoader
from roll_core.errors import DataError


def take(loader: StatefulLoader, n: int) -> list[list[int]]:
    return list(islice(loader, n))


def test_unshuffled_epochs_drop_the_tail() -> None:
    loader = StatefulLoader(10, 3, seed=0, shuffle=False)
    assert loader.batches_per_epoch == 3
    assert take(loader, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]  # 9 is dropped
    assert loader.epoch == 1
    assert loader.state_dict() == {"epoch": 1, "position": 3, "samples_seen": 12}


def test_keep_last() -> None:
    loader = StatefulLoader(10, 3, seed=0, shuffle=False, drop_last=False)
    assert loader.batches_per_epoch == 4
    assert take(loader, 5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [0, 1, 2]]


def test_shuffled_order_is_randperm_of_seed_plus_epoch() -> None:
    loader = StatefulLoader(6, 2, seed=7)
    epoch0 = torch.randperm(6, generator=torch.Generator().manual_seed(7)).tolist()
    epoch1 = torch.randperm(6, generator=torch.Generator().manual_seed(8)).tolist()
    assert take(loader, 6) == [
        epoch0[0:2],
        epoch0[2:4],
        epoch0[4:6],
        *[epoch1[i : i + 2] for i in (0, 2, 4)],
    ]
    assert epoch0 != epoch1


def test_resume_gives_the_same_batches() -> None:
    first = StatefulLoader(10, 3, seed=1)
    take(first, 7)  # 2 full epochs (3 batches each) + 1 batch
    state = first.state_dict()
    assert state == {"epoch": 2, "position": 3, "samples_seen": 21}
    expected = take(first, 5)

    resumed = StatefulLoader(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2
    assert take(resumed, 5) == expected
    assert resumed.state_dict() == first.state_dict()


def test_batch_larger_than_dataset() -> None:
    with pytest.raises(DataError, match="4 examples, fewer than one batch of 5"):
        StatefulLoader(4, 5, seed=0)
    loader = StatefulLoader(4, 5, seed=0, shuffle=False, drop_last=False)
    assert take(loader, 2) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_bad_arguments_and_state() -> None:
    with pytest.raises(DataError):
        StatefulLoader(0, 1, seed=0)
    with pytest.raises(DataError):
        StatefulLoader(5, 0, seed=0)
    loader = StatefulLoader(10, 3, seed=0)
    with pytest.raises(DataError, match="position 9"):
        loader.load_state_dict({"epoch": 0, "position": 9, "samples_seen": 9})
    with pytest.raises(DataError, match="missing"):
        loader.load_state_dict({"epoch": 0})
