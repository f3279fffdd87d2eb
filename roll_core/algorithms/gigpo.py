"""GiGPO: group-in-group policy optimisation for multi-turn agents (Feng et al. 2025,
arXiv 2505.10978).

Each training sample is one *step* of an episode. Two relative advantages are combined:

* episode level (the outer group): the G episodes of one env group share a seed; each episode's
  return ``R_i`` is compared with its group's,
  ``A^E_i = (R_i - mean_group(R)) / (std_group(R) + eps)`` (or no division), and every step of
  episode i gets ``A^E_i``;
* step level (the inner "anchor state" groups): steps of the same env group that act from the
  *same* environment state (equal ``state_key``) are compared by their discounted return from
  that step on, ``R_t = sum_{k >= t} gamma^(k-t) r_k``:
  ``A^S = (R_t - mean_anchor(R_t)) / (std_anchor(R_t) + eps)``.

The step's advantage is ``A = A^E + omega * A^S``.

A step whose anchor group holds only itself gets ``A^S = 0``, as in verl-agent's reference
implementation (its ``step_norm_reward`` subtracts the singleton's own mean). Standard
deviations are the unbiased (n - 1) ones, as in verl-agent.

Normalisation: ``norm="group"`` (roll's default) divides by the group's standard deviation,
as the paper's equations are written; verl-agent defaults to ``remove_std=True`` (no division:
``norm="none"`` here), which keeps a group whose returns are nearly equal from being scaled up.
roll defaults to the paper's form; ``gigpo.norm: none`` gives the reference code's.

Departure: the episode level weights each *episode* once, however many steps it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from roll_core.algorithms.functional import GroupIds, group_mean, group_std, groups_of

Norm = Literal["group", "none"]


def discounted_step_returns(rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """``R_t = r_t + gamma * R_{t+1}`` for every step of one episode (``R`` after the end is 0)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def relative_scores(
    scores: torch.Tensor, group_ids: GroupIds, *, norm: Norm = "group", eps: float = 1e-6
) -> torch.Tensor:
    """``scores - mean_group`` (divided by ``std_group + eps`` for ``norm="group"``), ``[N]``.

    A group of one sample gets 0.
    """
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    centred = scores - group_mean(scores, groups)
    if norm == "group":
        centred = centred / (group_std(scores, groups) + eps)
    elif norm != "none":
        raise ValueError(f"norm must be group or none, got {norm!r}")
    single = groups.counts[groups.inverse] < 2
    return torch.where(single, torch.zeros_like(centred), centred)


def gigpo_advantages(
    *,
    episode_returns: torch.Tensor,
    episode_group_ids: GroupIds,
    step_episode: torch.Tensor,
    step_returns: torch.Tensor,
    step_group_ids: GroupIds,
    omega: float = 1.0,
    norm: Norm = "group",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-step GiGPO advantages ``[B]`` and metrics.

    Args:
        episode_returns: ``[N]`` return of each episode.
        episode_group_ids: ``[N]`` env group of each episode (episodes sharing a seed).
        step_episode: ``[B]`` index (into the N episodes) of the episode of each step sample.
        step_returns: ``[B]`` discounted return from each step on
            (see :func:`discounted_step_returns`).
        step_group_ids: ``[B]`` anchor-state group of each step: equal ids for steps of the same
            env group acting from the same state (e.g. ``(group, state_key)`` pairs).
        omega: weight of the step-level advantage.
        norm: ``group`` divides by the group's standard deviation (+ ``eps``); ``none`` does not.
    """
    with torch.no_grad():
        a_episode = relative_scores(episode_returns.double(), episode_group_ids, norm=norm, eps=eps)
        a_step = relative_scores(step_returns.double(), step_group_ids, norm=norm, eps=eps)
        per_step_episode = a_episode[step_episode.long()]
        advantages = (per_step_episode + omega * a_step).to(step_returns.dtype)
    anchors = groups_of(step_group_ids, step_returns.shape[0])
    metrics = {
        "gigpo/episode_adv_abs_mean": float(per_step_episode.abs().mean()),
        "gigpo/step_adv_abs_mean": float(a_step.abs().mean()),
        "gigpo/anchor_groups": float(anchors.num),
        "gigpo/anchor_group_size_mean": float(anchors.counts.float().mean()),
        "gigpo/steps_in_shared_anchor": float((anchors.counts[anchors.inverse] > 1).float().mean()),
    }
    return advantages, metrics
