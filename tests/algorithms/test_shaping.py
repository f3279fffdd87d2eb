"""DAPO's overlong soft penalty and dynamic-sampling filter."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import groups_with_signal, overlong_penalty
from roll_core.errors import ConfigError


def test_overlong_penalty() -> None:
    # max 20, buffer 5 -> expected length 15: <= 15 -> 0 ; 16 -> (15 - 16) / 5 = -0.2 ;
    # 18 -> -0.6 ; 20 -> -1 ; 21 -> -1 ; times factor 0.5
    lengths = torch.tensor([10, 15, 16, 18, 20, 21])
    out = overlong_penalty(response_lengths=lengths, max_len=20, buffer_len=5, factor=0.5)
    assert_close(out, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]))


@pytest.mark.parametrize("buffer_len", [0, 21])
def test_overlong_buffer_must_fit(buffer_len: int) -> None:
    with pytest.raises(ConfigError, match="overlong buffer"):
        overlong_penalty(response_lengths=torch.tensor([1]), max_len=20, buffer_len=buffer_len)


def test_groups_with_signal() -> None:
    # a: 1, 1 (no signal) ; b: 0, 1 ; c: 0.5, 0.5 ; d: a single sample
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    ids = ["a", "a", "b", "b", "c", "c", "d"]
    keep = groups_with_signal(scores, ids)
    assert keep.tolist() == [False, False, True, True, False, False, False]
