"""Advantage estimators: rewards (and values) -> per-token advantages and returns.

Every estimator takes keyword arguments and returns ``(advantages, returns)``, both
``[B, T]`` and 0 on padding:

* ``token_rewards`` ``[B, T]``: the reward of each response token. For outcome rewards
  (math, code) the score sits on the last response token (see
  :func:`~roll_core.algorithms.functional.scores_to_token_rewards`); a KL penalty used as a
  reward (:func:`~roll_core.algorithms.kl.apply_kl_penalty`) adds a term on every token.
* ``response_mask`` ``[B, T]``: 1 on response tokens, 0 on padding (and on environment tokens
  of a multi-turn response, which the return computations skip).
* ``group_ids`` ``[B]``: group id per sample (the prompt it answers), for the group estimators.
  Groups may have unequal sizes; a group of one sample is a ConfigError.
* ``values`` ``[B, T]``: the critic's value of each token (``gae`` only).

``returns`` is the critic's regression target for ``gae`` and the discounted reward-to-go for
the others (not used by the loss; logged).

Look estimators up by name with :func:`compute_advantages` (registry :data:`ADV_ESTIMATORS`;
add your own with ``@ADV_ESTIMATORS.register("name")``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from roll_core.algorithms.functional import (
    GroupIds,
    discounted_returns,
    group_mean,
    group_std,
    groups_of,
    masked_whiten,
    require_group_size,
    sequence_scores,
)
from roll_core.algorithms.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry(
    "advantage estimator", key="algorithm.adv_estimator"
)
"""Advantage estimators by name."""


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1) * response_mask.to(per_sample.dtype)


@ADV_ESTIMATORS.register("gae")
def gae(
    *,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a critic (Schulman et al. 2015, arXiv 1506.02438).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    token by token from the end; ``returns = A + V`` (the lambda-return, the critic's target).
    The value after the last response token is 0 (the episode ends there).

    Departures: masked positions inside a response (environment tokens of a multi-turn episode)
    are skipped, i.e. ``t+1`` means the next *response* token, as in verl; advantages are not
    whitened here (the PPO preset turns on ``algorithm.advantage.whiten``, which whitens after
    every estimator).
    """
    m = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        last_adv = m[:, t] * adv_t + (1 - m[:, t]) * last_adv
        advantages[:, t] = last_adv
    advantages = advantages * m
    return advantages, (advantages + values) * m


@ADV_ESTIMATORS.register("grpo")
def grpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    norm_adv_by_std: Literal["group", "batch", "none"] = "group",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO, Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2).

    Each response's score ``s_i`` (sum of its token rewards) is compared with the other
    responses to the same prompt: ``A_i = (s_i - mean_group(s)) / (std_group(s) + eps)``, and
    every token of response i gets ``A_i`` ("outcome supervision").

    ``norm_adv_by_std`` picks the divisor: ``group`` (the paper), ``batch`` (the standard
    deviation of all scores of the batch: LitePPO, Liu et al. 2025, arXiv 2508.08221)
    or ``none`` (no division: Dr.GRPO, see :func:`dr_grpo`).

    Departures: the standard deviation is the unbiased (n - 1) one, as in verl and TRL (the
    paper does not say); ``eps`` keeps groups whose scores are all equal at advantage 0.
    """
    scores = sequence_scores(token_rewards, response_mask)
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    require_group_size(groups, what="the advantage estimator grpo")
    centred = scores - group_mean(scores, groups)
    if norm_adv_by_std == "group":
        centred = centred / (group_std(scores, groups) + eps)
    elif norm_adv_by_std == "batch":
        batch_std = scores.std() if scores.numel() > 1 else torch.zeros_like(scores[0])
        centred = centred / (batch_std + eps)
    elif norm_adv_by_std != "none":
        raise ValueError(f"norm_adv_by_std must be group, batch or none, got {norm_adv_by_std!r}")
    return _broadcast(centred, response_mask), discounted_returns(token_rewards, response_mask)


@ADV_ESTIMATORS.register("dr_grpo")
def dr_grpo(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO without the division by the group's standard deviation (Dr.GRPO, Liu et al. 2025,
    arXiv 2503.20783): ``A_i = s_i - mean_group(s)``.

    Dr.GRPO's other half, removing the ``1/|o_i|`` length normalisation, is the loss
    aggregation ``seq-mean-token-sum-norm`` (set by the dr_grpo preset). No departure.
    """
    scores = sequence_scores(token_rewards, response_mask)
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    require_group_size(groups, what="the advantage estimator dr_grpo")
    centred = scores - group_mean(scores, groups)
    return _broadcast(centred, response_mask), discounted_returns(token_rewards, response_mask)


@ADV_ESTIMATORS.register("rloo")
def rloo(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a leave-one-out baseline (RLOO; Kool et al. 2019; Ahmadian et al. 2024,
    arXiv 2402.14740): ``A_i = s_i - mean_{j != i} s_j``.

    Computed as ``n / (n - 1) * (s_i - mean_group(s))``, which is the same number. Departure:
    the paper treats the whole response as one action; here every token of the response gets
    ``A_i`` and the loss aggregation decides how tokens are weighted (the rloo preset uses
    ``token-mean``; ``seq-mean-token-sum`` is the paper's sequence-level REINFORCE).
    """
    scores = sequence_scores(token_rewards, response_mask)
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    require_group_size(groups, what="the advantage estimator rloo")
    n = groups.counts.to(scores.dtype)[groups.inverse]
    centred = (scores - group_mean(scores, groups)) * n / (n - 1)
    return _broadcast(centred, response_mask), discounted_returns(token_rewards, response_mask)


@ADV_ESTIMATORS.register("reinforce")
def reinforce(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain REINFORCE returns (Williams 1992, Machine Learning 8:229-256; no arXiv id):
    ``A_t = G_t = sum_{k >= t} gamma^(k-t) r_k`` over response tokens, no baseline.

    No departure; masked positions inside a response are skipped (see
    :func:`~roll_core.algorithms.functional.discounted_returns`).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return returns, returns


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): discounted returns, whitened over every
    response token of the batch ("global advantage normalisation").

    The paper's token-level KL penalty belongs in the rewards: compute
    ``token_rewards`` with :func:`~roll_core.algorithms.kl.apply_kl_penalty` (the
    reinforce_plus_plus preset sets ``algorithm.kl.use_as: reward`` with the k1 estimator).
    Departure: the variance is the unbiased one over tokens (as in OpenRLHF and verl).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask), returns


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a baseline (Hu et al. 2025, arXiv 2501.03262): subtract the group mean
    of the scores, give every token its response's value, then whiten over every response
    token of the batch.

    Departure: as in verl, the score is the sum of the token rewards (so a KL penalty used as a
    reward is folded into the outcome before the group mean is taken).
    """
    scores = sequence_scores(token_rewards, response_mask)
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    require_group_size(groups, what="the advantage estimator reinforce_plus_plus_baseline")
    centred = _broadcast(scores - group_mean(scores, groups), response_mask)
    advantages = masked_whiten(centred, response_mask)
    return advantages, discounted_returns(token_rewards, response_mask)


def compute_advantages(name: str, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as `name`: ``(advantages [B, T], returns [B, T])``.

    Pass every input the pipeline has (``token_rewards``, ``response_mask``, ``group_ids``,
    ``values``, ``gamma``, ``lam``, ``eps``, ``norm_adv_by_std``); each estimator takes the ones
    it needs and inputs that are None are ignored. No gradient flows through advantages.
    """
    fn = ADV_ESTIMATORS.get(name)
    with torch.no_grad():
        result: tuple[torch.Tensor, torch.Tensor] = ADV_ESTIMATORS.call(fn, name, inputs)
    return result
