"""The Tinker built-in losses of `roll serve` against numbers worked out by hand, and the
importance-sampling loss against roll's own policy loss on the same batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import policy_loss
from roll_core.algorithms.tinker_losses import datum_loss

F64 = torch.float64
ln = math.log


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def test_cross_entropy_is_the_weighted_negative_log_likelihood_sum() -> None:
    # logp = ln(0.5), ln(0.25), ln(0.1); weights 0, 1, 2
    # loss = 0 + ln 4 + 2 ln 10 = 1.386294 + 4.605170 = 5.991465
    logp = leaf([ln(0.5), ln(0.25), ln(0.1)])
    w = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    per_token = datum_loss("cross_entropy", logprobs=logp, inputs={"weights": w}, config={})
    assert_close(per_token, torch.tensor([0.0, ln(4), 2 * ln(10)], dtype=F64))
    assert per_token.sum().item() == pytest.approx(5.991465, abs=1e-6)
    per_token.sum().backward()
    assert_close(logp.grad, -w)  # d/dlogp of -w*logp


def test_importance_sampling_by_hand() -> None:
    # ratios r = exp(logp - q): 2, 0.5, 1; advantages 1, -2, 3
    # loss = -(2*1 + 0.5*(-2) + 1*3) = -4; d/dlogp = -r*A = -2, 1, -3
    q = torch.tensor([ln(0.2), ln(0.4), ln(0.3)], dtype=F64)
    logp = leaf([ln(0.4), ln(0.2), ln(0.3)])
    a = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    inputs = {"logprobs": q, "advantages": a}
    loss = datum_loss("importance_sampling", logprobs=logp, inputs=inputs, config={}).sum()
    assert loss.item() == pytest.approx(-4.0)
    loss.backward()
    assert_close(logp.grad, torch.tensor([-2.0, 1.0, -3.0], dtype=F64))


def test_ppo_clips_the_ratio_between_the_thresholds() -> None:
    # r = 2 (A = 1): min(2, clip(2) = 1.2) = 1.2, no gradient through the clip
    # r = 0.5 (A = -2): min(-1, 0.8*-2 = -1.6) = -1.6, clipped too
    # r = 1 (A = 3): 3, gradient -r*A = -3
    # loss = -(1.2 - 1.6 + 3) = -2.6
    q = torch.tensor([ln(0.2), ln(0.4), ln(0.3)], dtype=F64)
    logp = leaf([ln(0.4), ln(0.2), ln(0.3)])
    a = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    inputs = {"logprobs": q, "advantages": a}
    loss = datum_loss("ppo", logprobs=logp, inputs=inputs, config={}).sum()
    assert loss.item() == pytest.approx(-2.6)
    loss.backward()
    assert_close(logp.grad, torch.tensor([0.0, 0.0, -3.0], dtype=F64))
    # wider thresholds: nothing clipped, the importance-sampling loss
    logp2 = leaf([ln(0.4), ln(0.2), ln(0.3)])
    wide = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    assert datum_loss("ppo", logprobs=logp2, inputs=inputs, config=wide).sum().item() == (
        pytest.approx(-4.0)
    )


def test_cispo_weights_the_log_likelihood_by_the_clipped_ratio() -> None:
    # weights sg(clip(r, 0.8, 1.2)) = 1.2, 0.8, 1; gradient -w*A = -1.2, 1.6, -3
    q = torch.tensor([ln(0.2), ln(0.4), ln(0.3)], dtype=F64)
    logp = leaf([ln(0.4), ln(0.2), ln(0.3)])
    a = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    loss = datum_loss("cispo", logprobs=logp, inputs={"logprobs": q, "advantages": a}, config={})
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([-1.2, 1.6, -3.0], dtype=F64))


def test_importance_sampling_equals_roll_policy_loss_on_the_same_batch() -> None:
    """Tinker's `importance_sampling` summed over a batch's tokens is roll's `ppo` policy loss
    with the clip open (ratio never clipped) and the sum as aggregation (`token-mean` over a
    global token count of 1), with the sampler's log-probs as the old log-probs: value and
    gradient."""
    torch.manual_seed(0)
    q = torch.randn(3, 5, dtype=F64) - 2.0
    logp0 = q + 0.3 * torch.randn(3, 5, dtype=F64)
    adv = torch.randn(3, 5, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    # Tinker: each datum its own length; advantages 0 never needed: padding is simply absent
    ours_lp = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for row in range(3):
        n = int(mask[row].sum())
        inputs = {"logprobs": q[row, :n], "advantages": adv[row, :n]}
        total = (
            total
            + datum_loss(
                "importance_sampling", logprobs=ours_lp[row, :n], inputs=inputs, config={}
            ).sum()
        )
    total.backward()
    roll_lp = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(
        "ppo",
        log_probs=roll_lp,
        old_log_probs=q,
        advantages=adv,
        response_mask=mask,
        agg_mode="token-mean",
        global_num_tokens=1.0,
        clip_low=1.0,
        clip_high=1e9,
    )
    loss.backward()
    assert_close(total, loss)
    assert_close(ours_lp.grad, roll_lp.grad)


def test_bad_config_and_missing_inputs_are_named() -> None:
    logp = leaf([0.0])
    with pytest.raises(ValueError, match="clip_low_threshold"):
        datum_loss(
            "cross_entropy",
            logprobs=logp,
            inputs={"weights": torch.ones(1, dtype=F64)},
            config={"clip_low_threshold": 0.5},
        )
    with pytest.raises(KeyError, match="advantages"):
        datum_loss("ppo", logprobs=logp, inputs={"logprobs": torch.zeros(1)}, config={})
