"""Decoupled PPO (AReaL, arXiv 2505.24298) with hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import policy_loss


def lg(*p: float) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in p]])


def test_decoupled_ppo_by_hand() -> None:
    behaviour = lg(0.5, 0.1, 0.01)
    old = lg(0.5, 0.2, 0.5)  # proximal policy: w = old / behaviour = 1, 2, 50
    logp = lg(0.75, 0.2, 0.4).requires_grad_(True)  # r = logp / old = 1.5, 1, 0.8
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3)
    loss, m = policy_loss(
        "decoupled_ppo",
        log_probs=logp,
        old_log_probs=old,
        advantages=adv,
        response_mask=mask,
        infer_log_probs=behaviour,
        clip_low=0.2,
        clip_high=0.2,
    )
    # token 1: w=1, r=1.5 clipped to 1.2 -> max(-1.5, -1.2) = -1.2
    # token 2: w=2, r=1 -> -1 * 2 = -2
    # token 3: w=50 > cap 5 -> masked (weight 0)
    # token-mean: (-1.2 - 2 + 0) / 3
    assert float(loss) == pytest.approx((-1.2 - 2.0) / 3, abs=1e-6)
    assert m["actor/clipfrac"] == pytest.approx(1 / 3)
    assert m["actor/behav_weight_mean"] == pytest.approx(1.5)  # kept tokens: (1 + 2) / 2
    assert m["actor/behav_weight_max"] == pytest.approx(2.0)
    assert m["actor/behav_capfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp: token 1 clipped -> 0; token 2: -A * w * r / 3 = -2/3; token 3 masked -> 0
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -2 / 3, 0.0]]))


def test_on_policy_equals_ppo() -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 5, generator=g)
    logp = old + 0.3 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, 5, generator=g)
    mask = torch.ones(2, 5)
    a, _ = policy_loss("ppo", log_probs=logp, old_log_probs=old, advantages=adv, response_mask=mask)
    b, _ = policy_loss(
        "decoupled_ppo",
        log_probs=logp,
        old_log_probs=old,
        advantages=adv,
        response_mask=mask,
        infer_log_probs=old,  # behaviour == proximal: w = 1
    )
    assert float(a) == pytest.approx(float(b), abs=1e-7)


def test_without_behaviour_log_probs_it_is_ppo() -> None:
    x = dict(
        log_probs=lg(0.75, 0.2),
        old_log_probs=lg(0.5, 0.2),
        advantages=torch.tensor([[1.0, -1.0]]),
        response_mask=torch.ones(1, 2),
    )
    a, _ = policy_loss("ppo", **x)
    b, _ = policy_loss("decoupled_ppo", **x)
    assert float(a) == pytest.approx(float(b)) == pytest.approx((-1.2 + 1.0) / 2)


def _off_policy() -> dict[str, torch.Tensor]:
    return dict(
        log_probs=lg(0.5, 0.5),
        old_log_probs=lg(0.5, 0.5),
        advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2),
        infer_log_probs=lg(0.25, 0.05),  # w = 2 and 10
    )


def test_behaviour_cap_inf_removes_the_cap_and_none_keeps_the_default() -> None:
    # r = 1 everywhere, A = 1: token loss = -w. Cap 5 masks the w = 10 token:
    # (-2 + 0) / 2 = -1; no cap: (-2 - 10) / 2 = -6.
    default, _ = policy_loss("decoupled_ppo", **_off_policy())
    none, _ = policy_loss("decoupled_ppo", **_off_policy(), behaviour_cap=None)
    uncapped, m = policy_loss("decoupled_ppo", **_off_policy(), behaviour_cap=math.inf)
    assert float(default) == float(none) == pytest.approx(-1.0)
    assert float(uncapped) == pytest.approx(-6.0)
    assert m["actor/behav_capfrac"] == 0.0


def test_rollout_is_weights_are_not_applied_on_top_of_the_behaviour_weight() -> None:
    # With token TIS (algorithm.tis_cap or rollout_correction.is_level) the w = 2 token would
    # be weighted 2 x min(2, cap) = 4: the same correction twice.
    x = _off_policy()
    weights = torch.ones_like(x["response_mask"], dtype=torch.float32)
    with pytest.raises(ValueError, match="twice"):
        policy_loss("decoupled_ppo", **x, rollout_is_weights=weights)


def test_the_recipe_rejects_decoupled_ppo_with_tis_cap() -> None:
    from pydantic import ValidationError

    from roll_core.config.algorithm import AlgorithmConfig

    AlgorithmConfig(policy_loss="decoupled_ppo")
    AlgorithmConfig(policy_loss="ppo", tis_cap=2.0)
    with pytest.raises(ValidationError, match="tis_cap"):
        AlgorithmConfig(policy_loss="decoupled_ppo", tis_cap=2.0)
