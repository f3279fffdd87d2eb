"""Masked reductions, returns and group statistics, against numbers worked out by hand."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from roll_core.algorithms.functional import (
    discounted_returns,
    group_mean,
    group_std,
    groups_of,
    masked_mean,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
    sequence_scores,
)

F64 = torch.float64
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # masked entries: 1, 2, 4


def test_masked_mean_and_var() -> None:
    # mean = (1 + 2 + 4) / 3 = 7/3
    assert_close(masked_mean(VALUES, MASK), torch.tensor(7 / 3, dtype=F64))
    # per row: (1 + 2) / 2 = 1.5 ; 4 / 1 = 4
    assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0], dtype=F64))
    # deviations -4/3, -1/3, 5/3 -> squares 16/9 + 1/9 + 25/9 = 42/9; / (3 - 1) = 7/3
    assert_close(masked_var(VALUES, MASK), torch.tensor(7 / 3, dtype=F64))
    # population: 42/9 / 3 = 14/9
    assert_close(masked_var(VALUES, MASK, unbiased=False), torch.tensor(14 / 9, dtype=F64))


def test_masked_mean_of_empty_mask_is_zero() -> None:
    assert float(masked_mean(VALUES, torch.zeros_like(MASK))) == 0.0


def test_masked_whiten_ignores_and_zeroes_padding() -> None:
    s = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor(
        [[(1 - 7 / 3) / s, (2 - 7 / 3) / s, 0.0], [(4 - 7 / 3) / s, 0.0, 0.0]], dtype=F64
    )
    assert_close(masked_whiten(VALUES, MASK), expected)
    # shift_mean=False adds the mean back: x / s - mean / s + mean
    kept = torch.tensor([[1 / s - 7 / 3 / s + 7 / 3, 2 / s - 7 / 3 / s + 7 / 3, 0.0]], dtype=F64)
    assert_close(masked_whiten(VALUES, MASK, shift_mean=False)[:1], kept)


def test_scores_go_on_the_last_response_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    assert_close(sequence_scores(out, mask), torch.tensor([1.0, 2.0, 0.0]))


def test_discounted_returns_skip_masked_positions() -> None:
    # row 0: gamma 0.5, rewards 1, 0, 2 then padding: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5 = 1.5
    # row 1: the middle token is masked (an environment token): G2 = 2, G0 = 1 + .5*2 = 2
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.0], [1.0, 5.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    expected = torch.tensor([[1.5, 1.0, 2.0, 0.0], [2.0, 0.0, 2.0, 0.0]], dtype=F64)
    assert_close(discounted_returns(rewards, mask, gamma=0.5), expected)


def test_groups_from_strings_and_tensors() -> None:
    g = groups_of(["b", "a", "b"], 3)
    assert g.inverse.tolist() == [0, 1, 0] and g.counts.tolist() == [2, 1]
    assert g.labels == ["b", "a"]
    t = groups_of(torch.tensor([7, 3, 7]), 3)
    assert t.inverse.tolist() == [1, 0, 1] and t.labels == [3, 7]


def test_group_mean_and_unbiased_std_with_unequal_groups() -> None:
    scores = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0], dtype=F64)
    g = groups_of([0, 0, 0, 1, 1], 5)
    # group 0: mean 3, deviations -2, -1, 3 -> 4 + 1 + 9 = 14, / 2 = 7 -> std sqrt(7)
    # group 1: mean 4, std 0
    assert_close(group_mean(scores, g), torch.tensor([3.0, 3.0, 3.0, 4.0, 4.0], dtype=F64))
    r7 = math.sqrt(7)
    assert_close(group_std(scores, g), torch.tensor([r7, r7, r7, 0.0, 0.0], dtype=F64))
