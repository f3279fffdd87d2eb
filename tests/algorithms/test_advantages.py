"""Advantage estimators against numbers worked out by hand, with padding and unequal groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import ADV_ESTIMATORS, compute_advantages, scores_to_token_rewards
from roll_core.errors import ConfigError

F64 = torch.float64
# Five responses to two prompts (groups of 3 and 2) with lengths 3, 2, 1, 3, 2 (right padding).
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
SCORES = torch.tensor([1.0, 2.0, 6.0, 0.0, 1.0], dtype=F64)
REWARDS = scores_to_token_rewards(SCORES, MASK)


def per_token(values: list[float]) -> torch.Tensor:
    """Each response's advantage on each of its tokens, 0 on padding."""
    return torch.tensor(values, dtype=F64).unsqueeze(-1) * MASK.to(F64)


def run(name: str, **kw: object) -> torch.Tensor:
    adv, _ = compute_advantages(name, token_rewards=REWARDS, response_mask=MASK, **kw)
    return adv


def test_grpo_group_std() -> None:
    # group 0 scores 1, 2, 6: mean 3, unbiased std sqrt(14 / 2) = sqrt(7)
    # group 1 scores 0, 1: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    eps = 1e-6
    s0, s1 = math.sqrt(7) + eps, math.sqrt(0.5) + eps
    expected = [(1 - 3) / s0, (2 - 3) / s0, (6 - 3) / s0, -0.5 / s1, 0.5 / s1]
    assert_close(run("grpo", group_ids=GROUP_IDS), per_token(expected))


def test_grpo_batch_std_is_lite_ppo() -> None:
    # batch scores 1, 2, 6, 0, 1: mean 2, deviations -1, 0, 4, -2, -1 -> 22 / 4 = 5.5
    s = math.sqrt(5.5) + 1e-6
    expected = [-2 / s, -1 / s, 3 / s, -0.5 / s, 0.5 / s]
    assert_close(run("grpo", group_ids=GROUP_IDS, norm_adv_by_std="batch"), per_token(expected))


def test_dr_grpo_and_grpo_without_std_agree() -> None:
    expected = per_token([1 - 3, 2 - 3, 6 - 3, 0 - 0.5, 1 - 0.5])
    assert_close(run("dr_grpo", group_ids=GROUP_IDS), expected)
    assert_close(run("grpo", group_ids=GROUP_IDS, norm_adv_by_std="none"), expected)


def test_rloo_leave_one_out() -> None:
    # group 0: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5 ; group 1: 0 - 1, 1 - 0
    assert_close(run("rloo", group_ids=GROUP_IDS), per_token([-3.0, -1.5, 4.5, -1.0, 1.0]))


def test_reinforce_plus_plus_baseline_whitens_over_tokens() -> None:
    # centred scores -2, -1, 3, -0.5, 0.5 on 3, 2, 1, 3, 2 tokens (11 tokens):
    # sum = -6 - 2 + 3 - 1.5 + 1 = -5.5 -> mean -0.5
    # deviations -1.5 (x3), -0.5 (x2), 3.5 (x1), 0 (x3), 1 (x2)
    # squares 6.75 + 0.5 + 12.25 + 0 + 2 = 21.5 -> unbiased variance 21.5 / 10 = 2.15
    s = math.sqrt(2.15 + 1e-8)
    expected = [(-2 + 0.5) / s, (-1 + 0.5) / s, (3 + 0.5) / s, 0.0, (0.5 + 0.5) / s]
    adv = run("reinforce_plus_plus_baseline", group_ids=GROUP_IDS)
    assert_close(adv, per_token(expected))


def test_reward_on_several_tokens_counts_in_the_score() -> None:
    # a per-token term (e.g. a KL penalty) is part of the score: row 1 scores 2 - 0.5 = 1.5
    rewards = REWARDS.clone()
    rewards[1, 0] = -0.5
    adv, _ = compute_advantages(
        "dr_grpo", token_rewards=rewards, response_mask=MASK, group_ids=GROUP_IDS
    )
    # group 0 scores 1, 1.5, 6: mean 8.5 / 3
    m = 8.5 / 3
    assert_close(adv, per_token([1 - m, 1.5 - m, 6 - m, -0.5, 0.5]))


def test_reinforce_discounted_returns() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0: 1, 0.5, 0.25 backwards ; row 1: G1 = 2, G0 = 1, padding 0
    adv, returns = compute_advantages(
        "reinforce", token_rewards=rewards, response_mask=mask, gamma=0.5
    )
    expected = torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], dtype=F64)
    assert_close(adv, expected)
    assert_close(returns, expected)


def test_reinforce_plus_plus_whitens_returns_over_the_batch() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 1: returns 1, 1, 1 | 2, 2 ; mean 7/5 = 1.4
    # deviations -0.4 (x3), 0.6 (x2): 0.48 + 0.72 = 1.2 -> unbiased variance 1.2 / 4 = 0.3
    s = math.sqrt(0.3 + 1e-8)
    adv, returns = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=mask
    )
    lo, hi = -0.4 / s, 0.6 / s
    assert_close(adv, torch.tensor([[lo, lo, lo], [hi, hi, 0.0]], dtype=F64))
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], dtype=F64))


def test_gae_by_hand_with_padding_and_an_inner_mask() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72)
    # row 0, mask 1 1 0: t1: delta = 1 + 0.9*0 - 0.2 = 0.8, A1 = 0.8
    #                    t0: delta = 0 + 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.8 = 0.256
    # row 1, mask 1 0 1 (the middle token is skipped: the value after t0 is V2):
    #                    t2: delta = 1 - 0.2 = 0.8 ; t0: delta = 0.9*0.2 - 0.5 = -0.32,
    #                    A0 = -0.32 + 0.72*0.8 = 0.256
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 9.0], [0.5, 7.0, 0.2]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv, returns = compute_advantages(
        "gae", token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.8
    )
    assert_close(adv, torch.tensor([[0.256, 0.8, 0.0], [0.256, 0.0, 0.8]], dtype=F64))
    # returns = A + V on response tokens: 0.756, 1.0 | 0.756, 1.0
    assert_close(returns, torch.tensor([[0.756, 1.0, 0.0], [0.756, 0.0, 1.0]], dtype=F64))


def test_gae_with_gamma_and_lam_one_is_return_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.1, 0.2, 0.3]], dtype=F64)
    adv, _ = compute_advantages(
        "gae", token_rewards=rewards, values=values, response_mask=torch.ones(1, 3)
    )
    # A_t = G_t - V_t with G = 1 everywhere
    assert_close(adv, torch.tensor([[0.9, 0.8, 0.7]], dtype=F64))


def test_string_group_ids_match_integer_ones() -> None:
    ids = ["p0", "p0", "p0", "p1", "p1"]
    assert_close(run("rloo", group_ids=ids), run("rloo", group_ids=GROUP_IDS))


def test_non_adjacent_group_members() -> None:
    # group members interleaved: a b a b a -> scores a: 1, 6, 1 ; b: 2, 0
    ids = ["a", "b", "a", "b", "a"]
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 1.0], dtype=F64)
    adv, _ = compute_advantages(
        "dr_grpo",
        token_rewards=scores_to_token_rewards(scores, MASK),
        response_mask=MASK,
        group_ids=ids,
    )
    # a: mean 8/3 ; b: mean 1
    assert_close(adv, per_token([1 - 8 / 3, 2 - 1, 6 - 8 / 3, 0 - 1, 1 - 8 / 3]))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_of_one_sample_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        run(name, group_ids=torch.tensor([0, 0, 0, 1, 2]))
    err = info.value
    assert f"the advantage estimator {name}" in err.message
    assert "at least 2 samples per group" in err.message and "2 of 3 groups" in err.message
    assert "rollout.n" in (err.hint or "")


def test_padding_and_the_response_mask() -> None:
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv = run(name, group_ids=GROUP_IDS)
        assert bool((adv[MASK == 0] == 0).all()), name


def test_dispatch_takes_what_each_estimator_needs() -> None:
    # values and lam are ignored by grpo; None means "not given" (grpo's default: group std)
    a = run("grpo", group_ids=GROUP_IDS, values=torch.zeros(5, 3), lam=0.5, norm_adv_by_std=None)
    assert_close(a, run("grpo", group_ids=GROUP_IDS))
    with pytest.raises(ValueError, match="advantage estimator 'grpo' needs group_ids"):
        run("grpo")
    with pytest.raises(TypeError, match="unexpected argument.*gamma_"):
        run("reinforce", gamma_=0.5)


def test_unknown_estimator_suggests_the_closest() -> None:
    with pytest.raises(ConfigError) as info:
        run("grop", group_ids=GROUP_IDS)
    assert "unknown advantage estimator 'grop'. Did you mean 'grpo'?" in info.value.message
    assert "algorithm.adv_estimator" in (info.value.hint or "")
    for name in ADV_ESTIMATORS:
        assert name in (info.value.hint or "")


def test_no_gradient_through_advantages() -> None:
    rewards = REWARDS.clone().requires_grad_(True)
    adv, _ = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=MASK, group_ids=GROUP_IDS
    )
    assert not adv.requires_grad
