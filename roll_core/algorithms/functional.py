"""Masked reductions and group statistics shared by the algorithm modules.

Shapes: token tensors are ``[batch, resp_len]`` (written ``[B, T]``); ``response_mask`` is
``[B, T]`` with 1 on response tokens and 0 on padding (any dtype; it is cast to the values'
dtype). Per-sample tensors are ``[B]``. Groups are given by ``group_ids``: one group id per sample
(a tensor of integers, or any sequence of hashable ids such as prompt uids); the samples of a
group need not be adjacent and groups may have different sizes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from roll_core.errors import ConfigError

GroupIds = torch.Tensor | Sequence[Hashable]
"""Group id per sample: a ``[B]`` integer tensor or a sequence of hashable ids."""

WHITEN_EPS = 1e-8
"""Added to the variance before the square root when whitening (as verl and OpenRLHF do)."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (over `dim`, or over everything when None)."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 where the mask is empty (never NaN)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (Bessel-corrected when `unbiased`; 0 for < 2 entries)."""
    m = mask.to(values.dtype)
    count = m.sum()
    mean = masked_sum(values, m) / count.clamp(min=1)
    sq = masked_sum((values - mean) ** 2, m)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` over the masked entries; padding comes back 0.

    Mean and (unbiased) variance are taken over every masked entry of the whole tensor, i.e. over
    tokens, so a long response weighs more than a short one. With ``shift_mean=False`` the mean
    is added back (scale only).
    """
    m = mask.to(values.dtype)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    out = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample score ``[B]``: the sum of the token-level rewards over response tokens."""
    return masked_sum(token_rewards, response_mask, dim=-1)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar score ``[B]`` on its last response token: ``[B, T]``.

    Rows without a response token get no reward.
    """
    m = response_mask.to(torch.long)
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m > 0, positions, -1).amax(dim=-1)
    has_token = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_token]
    out[rows, last[has_token]] = scores[has_token]
    return out


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_next`` over response tokens, ``[B, T]``.

    ``G_next`` is the return at the next *response* token: masked positions (padding, or
    environment tokens inside a multi-turn response) are skipped, neither discounted nor
    rewarded, and come back 0.
    """
    m = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        step = token_rewards[:, t] + gamma * running
        running = m[:, t] * step + (1 - m[:, t]) * running
        returns[:, t] = running
    return returns * m


@dataclass(frozen=True)
class Groups:
    """Dense group ids for a batch: ``inverse[b]`` is the group (0..num-1) of sample b."""

    inverse: torch.Tensor
    counts: torch.Tensor
    labels: list[Hashable]

    @property
    def num(self) -> int:
        """Number of distinct groups."""
        return len(self.labels)


def groups_of(group_ids: GroupIds, batch_size: int, device: torch.device | None = None) -> Groups:
    """Map group ids (any hashable ids, or an integer tensor) to dense ids ``0..G-1``."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(
                f"group_ids must have shape [{batch_size}], got {tuple(group_ids.shape)}"
            )
        uniq, inverse = torch.unique(group_ids, return_inverse=True)
        labels: list[Hashable] = uniq.tolist()
        inverse = inverse.to(device) if device is not None else inverse
    else:
        ids = list(group_ids)
        if len(ids) != batch_size:
            raise ValueError(f"group_ids must have {batch_size} entries, got {len(ids)}")
        order: dict[Hashable, int] = {}
        dense = [order.setdefault(i, len(order)) for i in ids]
        labels = list(order)
        inverse = torch.tensor(dense, dtype=torch.long, device=device)
    counts = torch.bincount(inverse, minlength=len(labels))
    return Groups(inverse=inverse, counts=counts, labels=labels)


def require_group_size(groups: Groups, *, what: str, minimum: int = 2) -> None:
    """ConfigError when a group has fewer than `minimum` samples (`what` names the caller)."""
    small = (groups.counts < minimum).nonzero().flatten().tolist()
    if not small:
        return
    first, size = groups.labels[small[0]], int(groups.counts[small[0]])
    raise ConfigError(
        f"{what} compares the samples of one prompt with each other and needs at least "
        f"{minimum} samples per group, but {len(small)} of {groups.num} groups have fewer "
        f"(group {first!r} has {size} sample{'' if size == 1 else 's'}).",
        hint="Generate several responses per prompt (rollout.n: 2 or more), or use a "
        "per-sample estimator: algorithm.adv_estimator reinforce, reinforce_plus_plus or gae.",
    )


def group_mean(scores: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Mean score of each sample's group, ``[B]``."""
    sums = torch.zeros(groups.num, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, groups.inverse, scores)
    means = sums / groups.counts.to(scores.dtype).clamp(min=1)
    return means[groups.inverse]


def group_std(scores: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Unbiased (n - 1) standard deviation of each sample's group, ``[B]`` (0 for size 1)."""
    dev = (scores - group_mean(scores, groups)) ** 2
    sums = torch.zeros(groups.num, dtype=scores.dtype, device=scores.device)
    sums.index_add_(0, groups.inverse, dev)
    var = sums / (groups.counts.to(scores.dtype) - 1).clamp(min=1)
    return var.sqrt()[groups.inverse]
