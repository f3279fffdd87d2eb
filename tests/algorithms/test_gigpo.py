"""GiGPO advantages (arXiv 2505.10978) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.gigpo import discounted_step_returns, gigpo_advantages, relative_scores


def test_discounted_step_returns() -> None:
    # rewards 0, 0, 1 with gamma 0.5: R2 = 1, R1 = 0 + 0.5 * 1 = 0.5, R0 = 0 + 0.5 * 0.5 = 0.25
    assert discounted_step_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_step_returns([-0.1, 1.0], 1.0) == pytest.approx([0.9, 1.0])
    assert discounted_step_returns([], 0.9) == []


def test_relative_scores_and_singletons() -> None:
    scores = torch.tensor([1.0, 3.0, 5.0, 7.0])
    # group 0: {1, 3}: mean 2, unbiased std sqrt(2) -> -1/sqrt2, +1/sqrt2; group 1: {5}: alone -> 0
    out = relative_scores(scores, torch.tensor([0, 0, 1, 2]), eps=0.0)
    s = 1 / math.sqrt(2)
    assert out.tolist() == pytest.approx([-s, s, 0.0, 0.0])
    out = relative_scores(scores, torch.tensor([0, 0, 1, 1]), norm="none")
    assert out.tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0])


def test_gigpo_combines_episode_and_anchor_state_advantages() -> None:
    # One env group of two episodes (same seed, so both start in state "s0").
    #   episode 0: s0 -> s1 -> goal, rewards 0, 1   return 1
    #   episode 1: s0 -> s2,  stuck, rewards 0, 0   return 0
    # Episode level (norm none): A^E = (1 - 0.5, 0 - 0.5) = (+0.5, -0.5).
    # Steps, gamma 1: ep0 t0 R=1 (s0), ep0 t1 R=1 (s1), ep1 t0 R=0 (s0), ep1 t1 R=0 (s2).
    # Anchor groups: s0 = {ep0 t0, ep1 t0} -> mean 0.5 -> A^S = +0.5, -0.5; s1 and s2 alone -> 0.
    # A = A^E + omega * A^S with omega 2: [0.5 + 1, 0.5 + 0, -0.5 - 1, -0.5 + 0].
    adv, metrics = gigpo_advantages(
        episode_returns=torch.tensor([1.0, 0.0]),
        episode_group_ids=torch.tensor([0, 0]),
        step_episode=torch.tensor([0, 0, 1, 1]),
        step_returns=torch.tensor([1.0, 1.0, 0.0, 0.0]),
        step_group_ids=torch.tensor([0, 1, 0, 2]),
        omega=2.0,
        norm="none",
    )
    assert adv.tolist() == pytest.approx([1.5, 0.5, -1.5, -0.5])
    assert metrics["gigpo/anchor_groups"] == 3.0
    assert metrics["gigpo/steps_in_shared_anchor"] == pytest.approx(0.5)


def test_gigpo_normalises_per_group_and_weights_episodes_once() -> None:
    # Two env groups. Group A: returns 2 and 0 (episode 0 has 3 steps, episode 1 has 1 step);
    # the episode mean is over episodes (1.0), not over steps (which would give 1.5).
    # With norm group: std of {2, 0} = sqrt(2) -> A^E = +-1/sqrt(2) (eps 0).
    # Group B: returns 1 and 1 -> std 0 -> A^E = 0 / (0 + eps) = 0.
    # omega 0: the step level does not count.
    adv, _ = gigpo_advantages(
        episode_returns=torch.tensor([2.0, 0.0, 1.0, 1.0]),
        episode_group_ids=torch.tensor([7, 7, 9, 9]),
        step_episode=torch.tensor([0, 0, 0, 1, 2, 3]),
        step_returns=torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0, 1.0]),
        step_group_ids=torch.tensor([0, 1, 2, 3, 4, 5]),
        omega=0.0,
        norm="group",
        eps=1e-6,
    )
    s = 2 / (math.sqrt(2) + 1e-6) / 2  # (2 - 1) / (sqrt 2 + eps)
    assert adv.tolist() == pytest.approx([s, s, s, -s, 0.0, 0.0], abs=1e-6)


def test_anchor_groups_normalise_by_their_std() -> None:
    # three steps from the same state with returns 0, 1, 2: mean 1, unbiased std 1 -> -1, 0, 1
    adv, _ = gigpo_advantages(
        episode_returns=torch.tensor([0.0, 0.0, 0.0]),
        episode_group_ids=torch.tensor([0, 0, 0]),
        step_episode=torch.tensor([0, 1, 2]),
        step_returns=torch.tensor([0.0, 1.0, 2.0]),
        step_group_ids=torch.tensor([5, 5, 5]),
        omega=1.0,
        eps=1e-9,
    )
    # the episode level is 0 / (0 + eps) = 0: all three episodes returned 0
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0])
