"""Reward normalisation and clipping, advantage whitening and clipping.

Reward functions act on per-sample scores ``[B]`` (before they are placed on the last token);
advantage functions act on ``[B, T]`` with the response mask.
"""

from __future__ import annotations

import math

import torch

from roll_core.algorithms.functional import (
    GroupIds,
    group_mean,
    group_std,
    groups_of,
    masked_whiten,
    require_group_size,
)
from roll_core.algorithms.registry import unknown_name_error

REWARD_NORMALIZERS = ("none", "batch", "group", "running")
"""Valid `mode`s of :func:`normalize_rewards` (the recipe key `algorithm.reward.normalize`)."""


class RunningMeanStd:
    """Running mean and variance of every score seen so far, checkpointable.

    Batches are merged with the parallel formula of Chan, Golub and LeVeque (1979): exact, in
    float64, independent of how the stream is cut into batches. The variance is the population
    one. Save :meth:`state_dict` with the run's checkpoint so a resumed run normalises exactly
    as one that never stopped.
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def update(self, values: torch.Tensor) -> None:
        """Fold a batch of values (any shape) into the statistics."""
        x = values.detach().to(torch.float64).flatten()
        n = int(x.numel())
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_var = float(((x - batch_mean) ** 2).mean())
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen so far."""
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float | int]:
        """``{"mean", "var", "count"}`` for checkpoints."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore from :meth:`state_dict`."""
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.count = int(state["count"])


def normalize_rewards(
    mode: str,
    *,
    scores: torch.Tensor,
    group_ids: GroupIds | None = None,
    running: RunningMeanStd | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise per-sample scores ``[B]``: ``(s - mean) / (std + eps)`` over a scope.

    * ``none``: unchanged;
    * ``batch``: mean and unbiased std of this batch;
    * ``group``: mean and unbiased std of each sample's group (`group_ids`; every group needs two
      samples or more);
    * ``running``: `running` is first updated with this batch, then its mean and std are used
      (the reward scaling of PPO implementations, e.g. Engstrom et al. 2020, arXiv 2005.12729,
      which scale by a running std; here the running mean is subtracted too, as
      OpenRLHF's reward normalisation does).
    """
    if mode not in REWARD_NORMALIZERS:
        raise unknown_name_error(
            "reward normalisation", mode, list(REWARD_NORMALIZERS), key="algorithm.reward.normalize"
        )
    if mode == "none":
        return scores
    if mode == "batch":
        std = scores.std() if scores.numel() > 1 else torch.zeros_like(scores.sum())
        return (scores - scores.mean()) / (std + eps)
    if mode == "group":
        if group_ids is None:
            raise ValueError("group reward normalisation needs group_ids (group id per sample)")
        groups = groups_of(group_ids, scores.shape[0], scores.device)
        require_group_size(groups, what="group reward normalisation")
        return (scores - group_mean(scores, groups)) / (group_std(scores, groups) + eps)
    if running is None:
        raise ValueError("running reward normalisation needs a RunningMeanStd")
    running.update(scores)
    return (scores - running.mean) / (running.std + eps)


def clip_rewards(rewards: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Clamp rewards to ``[-clip, clip]`` (None: unchanged)."""
    if clip is None:
        return rewards
    if clip <= 0:
        raise ValueError(f"reward clip must be positive, got {clip}")
    return rewards.clamp(-clip, clip)


def whiten_advantages(
    advantages: torch.Tensor, response_mask: torch.Tensor, *, shift_mean: bool = True
) -> torch.Tensor:
    """Whiten advantages ``[B, T]`` over every response token of the batch (masked; padding 0).

    The usual PPO advantage normalisation (e.g. Andrychowicz et al. 2020, arXiv 2006.05990,
    verl whitens inside GAE). ``shift_mean=False`` only scales.
    """
    return masked_whiten(advantages, response_mask, shift_mean=shift_mean)


def clip_advantages(advantages: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Clamp advantages to ``[-clip, clip]`` (None: unchanged)."""
    if clip is None:
        return advantages
    if clip <= 0:
        raise ValueError(f"advantage clip must be positive, got {clip}")
    return advantages.clamp(-clip, clip)
