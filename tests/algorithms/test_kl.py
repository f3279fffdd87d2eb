"""KL estimators, the KL reward penalty, the KL loss and the coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
    make_kl_controller,
)
from roll_core.errors import ConfigError

F64 = torch.float64
L2 = math.log(2)
# token 0: logp = ln 0.5, ref = ln 0.25 (logp - ref = ln 2) ; token 1: the other way round
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64)
REF = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=F64)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [L2, -L2]),  # logp - ref
        ("k2", [L2**2 / 2, L2**2 / 2]),  # (logp - ref)^2 / 2
        # k3 = e^d - d - 1 with d = ref - logp: d = -ln 2 -> 0.5 + ln 2 - 1 ; d = ln 2 -> 2 - ln 2 - 1
        ("k3", [0.5 + L2 - 1, 2 - L2 - 1]),
        ("low_var_k3", [0.5 + L2 - 1, 2 - L2 - 1]),  # equal to k3 away from the clamps
    ],
)
def test_estimators(estimator: str, expected: list[float]) -> None:
    out = kl_estimate(estimator, log_probs=LOGP, ref_log_probs=REF)
    assert_close(out, torch.tensor([expected], dtype=F64))


def test_low_var_k3_clamps_extreme_ratios() -> None:
    logp = torch.tensor([[0.0, 0.0, -30.0]], dtype=F64)
    ref = torch.tensor([[5.0, -25.0, 0.0]], dtype=F64)
    # d = 5: k3 = e^5 - 6 = 142.41 -> 10 ; d = -25 -> -20: e^-20 + 19 -> 10 ; d = 30 -> 20 -> 10
    low = kl_estimate("low_var_k3", log_probs=logp, ref_log_probs=ref)
    assert_close(low, torch.tensor([[10.0, 10.0, 10.0]], dtype=F64))
    k3 = kl_estimate("k3", log_probs=logp[:, :1], ref_log_probs=ref[:, :1])
    assert float(k3) == pytest.approx(math.exp(5) - 6)


def test_kl_penalty_in_the_reward() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # logp - ref: row 0: ln 2, -ln 2, 0 ; row 1: ln 2, ln 2, (padding 5)
    logp = torch.tensor([[L2, -L2, 0.0], [L2, L2, 5.0]], dtype=F64)
    ref = torch.zeros(2, 3, dtype=F64)
    rewards, metrics = apply_kl_penalty(
        token_scores=scores,
        log_probs=logp,
        ref_log_probs=ref,
        response_mask=mask,
        coef=0.1,
        estimator="k1",
    )
    c = 0.1 * L2
    assert_close(rewards, torch.tensor([[-c, c, 1.0], [-c, 2.0 - c, 0.0]], dtype=F64))
    # per-response mean KL: row 0 (ln2 - ln2 + 0) / 3 = 0 ; row 1 ln 2 -> batch mean ln 2 / 2
    assert metrics["actor/reward_kl"] == pytest.approx(L2 / 2)
    assert metrics["actor/reward_kl_coef"] == pytest.approx(0.1)


def test_kl_loss_value_and_gradient() -> None:
    logp = torch.tensor([[L2, -L2, 0.0], [L2, L2, 5.0]], dtype=F64, requires_grad=True)
    ref = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # k3 per token: ln2 -> 0.5 + ln2 - 1 = 0.19315 ; -ln2 -> 2 - ln2 - 1 = 0.30685 ; 0 -> 0
    # token-mean over 5 tokens: (3 * 0.19315 + 0.30685) / 5
    k_pos, k_neg = 0.5 + L2 - 1, 2 - L2 - 1
    mean = (3 * k_pos + k_neg) / 5
    loss, metrics = kl_loss(
        log_probs=logp, ref_log_probs=ref, response_mask=mask, coef=0.5, estimator="k3"
    )
    assert_close(loss, torch.tensor(0.5 * mean, dtype=F64))
    assert metrics["actor/kl_loss"] == pytest.approx(mean)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): at logp = ln 2: 1 - 0.5 = 0.5 ; x coef 0.5 / 5 tokens
    assert float(logp.grad[0, 0]) == pytest.approx(0.5 * 0.5 / 5)
    assert float(logp.grad[1, 2]) == 0.0


def test_adaptive_controller() -> None:
    ctl = AdaptiveKLController(0.1, target=0.05, horizon=100)
    # error = clip(0.1 / 0.05 - 1, -0.2, 0.2) = 0.2 ; coef *= 1 + 0.2 * 10 / 100 = 1.02
    ctl.update(0.1, n_steps=10)
    assert ctl.value == pytest.approx(0.102)
    # error = 0.045 / 0.05 - 1 = -0.1 ; coef *= 1 - 0.1 * 10 / 100 = 0.99
    ctl.update(0.045, n_steps=10)
    assert ctl.value == pytest.approx(0.102 * 0.99)
    other = AdaptiveKLController(0.1, target=0.05, horizon=100)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value


def test_fixed_controller_and_factory() -> None:
    fixed = make_kl_controller(coef=0.2)
    assert isinstance(fixed, FixedKLController)
    fixed.update(10.0, n_steps=1000)
    assert fixed.value == 0.2
    assert isinstance(make_kl_controller(coef=0.2, target=0.1), AdaptiveKLController)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_unknown_estimator() -> None:
    with pytest.raises(ConfigError) as info:
        kl_estimate("k33", log_probs=LOGP, ref_log_probs=REF)
    assert "Did you mean 'k3'?" in info.value.message
    assert "k1, k2, k3, low_var_k3" in (info.value.hint or "")
