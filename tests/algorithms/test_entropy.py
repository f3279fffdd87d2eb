"""Token entropy from logits and the entropy bonus."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import entropy_bonus, entropy_from_logits

# uniform over 2 -> ln 2 ; probabilities 1/4, 3/4 (logits 0, ln 3) ->
# -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.25 ln 4 + 0.75 ln(4/3)
H2 = math.log(2)
H13 = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [50.0, -50.0]]])
    out = entropy_from_logits(logits)
    assert out.shape == (1, 3)
    assert_close(out, torch.tensor([[H2, H13, 0.0]]), atol=1e-6, rtol=1e-6)


def test_entropy_is_float32_for_bf16_logits() -> None:
    logits = torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    assert float(out) == pytest.approx(math.log(4), rel=1e-6)


def test_entropy_bonus() -> None:
    entropy = torch.tensor([[H2, H13, 99.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    # token-mean over 2 tokens: (ln 2 + H13) / 2 ; loss = -0.01 * that
    loss, metrics = entropy_bonus(entropy=entropy, response_mask=mask, coef=0.01)
    mean = (H2 + H13) / 2
    assert float(loss.detach()) == pytest.approx(-0.01 * mean, rel=1e-6)
    assert metrics["actor/entropy"] == pytest.approx(mean, rel=1e-6)
    loss.backward()
    assert_close(entropy.grad, torch.tensor([[-0.005, -0.005, 0.0]]))
