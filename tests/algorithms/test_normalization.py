"""Reward normalisation and clipping, advantage whitening and clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import (
    RunningMeanStd,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    whiten_advantages,
)
from roll_core.errors import ConfigError

F64 = torch.float64
SCORES = torch.tensor([1.0, 2.0, 6.0, 0.0, 1.0], dtype=F64)
EPS = 1e-6


def test_batch() -> None:
    # mean 2 ; deviations -1, 0, 4, -2, -1 -> 22 / 4 = 5.5
    s = math.sqrt(5.5) + EPS
    expected = torch.tensor([-1 / s, 0.0, 4 / s, -2 / s, -1 / s], dtype=F64)
    assert_close(normalize_rewards("batch", scores=SCORES), expected)


def test_group_with_unequal_sizes() -> None:
    # group 0: 1, 2, 6 (mean 3, std sqrt 7) ; group 1: 0, 1 (mean 0.5, std sqrt 0.5)
    a, b = math.sqrt(7) + EPS, math.sqrt(0.5) + EPS
    expected = torch.tensor([-2 / a, -1 / a, 3 / a, -0.5 / b, 0.5 / b], dtype=F64)
    out = normalize_rewards("group", scores=SCORES, group_ids=[0, 0, 0, 1, 1])
    assert_close(out, expected)
    with pytest.raises(ConfigError, match="group reward normalisation"):
        normalize_rewards("group", scores=SCORES, group_ids=[0, 0, 0, 1, 2])


def test_running_stats_merge_batches_exactly() -> None:
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    # mean 2, population variance (1 + 0 + 1) / 3 = 2/3
    assert (rms.mean, rms.count) == (2.0, 3)
    assert rms.var == pytest.approx(2 / 3)
    rms.update(torch.tensor([4.0, 5.0]))
    # all of 1..5: mean 3, population variance (4 + 1 + 0 + 1 + 4) / 5 = 2
    assert rms.mean == pytest.approx(3.0) and rms.var == pytest.approx(2.0)


def test_running_normalisation_and_checkpoint() -> None:
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    restored = RunningMeanStd()
    restored.load_state_dict(rms.state_dict())
    batch = torch.tensor([4.0, 5.0], dtype=F64)
    # after folding in 4, 5: mean 3, std sqrt 2 -> (4 - 3) / sqrt 2, (5 - 3) / sqrt 2
    s = math.sqrt(2) + EPS
    expected = torch.tensor([1 / s, 2 / s], dtype=F64)
    assert_close(normalize_rewards("running", scores=batch, running=rms), expected)
    assert_close(normalize_rewards("running", scores=batch, running=restored), expected)
    assert restored.state_dict() == rms.state_dict()


def test_none_and_unknown_mode() -> None:
    assert normalize_rewards("none", scores=SCORES) is SCORES
    with pytest.raises(ConfigError, match="Did you mean 'group'"):
        normalize_rewards("groups", scores=SCORES)


def test_clipping() -> None:
    x = torch.tensor([-3.0, 0.5, 2.0])
    assert_close(clip_rewards(x, 1.0), torch.tensor([-1.0, 0.5, 1.0]))
    assert_close(clip_advantages(x, 2.5), torch.tensor([-2.5, 0.5, 2.0]))
    assert clip_rewards(x, None) is x and clip_advantages(x, None) is x
    with pytest.raises(ValueError):
        clip_advantages(x, 0.0)


def test_whiten_advantages_masked() -> None:
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # entries 1, 2, 4: mean 7/3, unbiased variance 7/3
    s = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor(
        [[(1 - 7 / 3) / s, (2 - 7 / 3) / s, 0.0], [(4 - 7 / 3) / s, 0.0, 0.0]], dtype=F64
    )
    assert_close(whiten_advantages(adv, mask), expected)
