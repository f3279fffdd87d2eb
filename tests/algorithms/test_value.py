"""The clipped value loss."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import value_loss

F64 = torch.float64


def inputs() -> dict[str, torch.Tensor]:
    return {
        "values": torch.tensor([[1.0, 2.0, 7.0]], dtype=F64, requires_grad=True),
        "old_values": torch.tensor([[0.5, 2.1, 0.0]], dtype=F64),
        "returns": torch.tensor([[2.0, 1.0, 0.0]], dtype=F64),
        "response_mask": torch.tensor([[1, 1, 0]]),
    }


def test_clipped_value_loss() -> None:
    # token 0: (1 - 2)^2 = 1 ; clipped value 0.5 + clamp(0.5, +-0.2) = 0.7 -> (0.7 - 2)^2 = 1.69
    #          max = 1.69 (the clipped term: counted in clipfrac)
    # token 1: (2 - 1)^2 = 1 ; clipped 2.1 + clamp(-0.1) = 2.0 -> 1 ; max = 1
    # loss = 0.5 * (1.69 + 1) / 2 = 0.6725
    x = inputs()
    loss, metrics = value_loss(**x, clip=0.2)
    assert float(loss.detach()) == pytest.approx(0.6725)
    assert metrics["critic/vf_loss"] == pytest.approx(0.6725)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.5)
    assert metrics["critic/vpred_mean"] == pytest.approx(1.5)
    loss.backward()
    # token 0 is clipped: no gradient ; token 1: 0.5 * 2 * (2 - 1) / 2 tokens = 0.5
    assert_close(x["values"].grad, torch.tensor([[0.0, 0.5, 0.0]], dtype=F64))


def test_unclipped_value_loss() -> None:
    # 0.5 * ((1 - 2)^2 + (2 - 1)^2) / 2 = 0.5
    loss, metrics = value_loss(**inputs(), clip=None)
    assert float(loss.detach()) == pytest.approx(0.5)
    assert metrics["critic/vf_clipfrac"] == 0.0
