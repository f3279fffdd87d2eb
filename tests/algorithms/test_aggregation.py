"""Loss aggregation modes against numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import LOSS_AGG_MODES, agg_loss
from roll_core.errors import ConfigError

F64 = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is empty (e.g. filtered)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 sequences
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-sum-norm", 7 / 6),  # ((1 + 2) + 4) / (2 sequences * T = 3)
    ],
)
def test_modes(mode: str, expected: float) -> None:
    assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected, dtype=F64))


def test_sum_norm_uses_the_given_constant_length() -> None:
    # (3 + 4) / (2 sequences * 10)
    out = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10)
    assert_close(out, torch.tensor(0.35, dtype=F64))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_shares_add_up_to_the_whole_batch(mode: str) -> None:
    whole = agg_loss(LOSS, MASK, mode, max_len=3)
    # global batch: 3 response tokens, 2 non-empty sequences
    shares = [
        agg_loss(
            LOSS[i : i + 1],
            MASK[i : i + 1],
            mode,
            max_len=3,
            global_num_tokens=3,
            global_num_seqs=2,
        )
        for i in range(3)
    ]
    assert_close(sum(shares), whole)


def test_token_mean_share_by_hand() -> None:
    # row 0 of a global batch with 3 tokens: (1 + 2) / 3 = 1 ; row 1: 4 / 3
    assert float(agg_loss(LOSS[:1], MASK[:1], "token-mean", global_num_tokens=3)) == 1.0
    assert_close(
        agg_loss(LOSS[1:2], MASK[1:2], "token-mean", global_num_tokens=3),
        torch.tensor(4 / 3, dtype=F64),
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero(mode: str) -> None:
    assert float(agg_loss(LOSS, torch.zeros_like(MASK), mode)) == 0.0


def test_unknown_mode() -> None:
    with pytest.raises(ConfigError) as info:
        agg_loss(LOSS, MASK, "token_mean")
    assert "Did you mean 'token-mean'?" in info.value.message
    assert "algorithm.loss_agg_mode" in (info.value.hint or "")
