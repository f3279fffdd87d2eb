"""Reward shaping and sample filtering of DAPO: the overlong soft penalty and the dynamic
sampling filter (Yu et al. 2025, arXiv 2503.14476, sec. 3.2 and 3.4)."""

from __future__ import annotations

import torch

from roll_core.algorithms.functional import GroupIds, groups_of
from roll_core.errors import ConfigError


def overlong_penalty(
    *,
    response_lengths: torch.Tensor,
    max_len: int,
    buffer_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, sec. 3.4), per sample ``[B]``.

    With ``L_exp = max_len - buffer_len``: 0 for ``|y| <= L_exp``; ``(L_exp - |y|) / buffer_len``
    (from 0 down to -1) inside the buffer; -1 beyond ``max_len``. The result is multiplied by
    `factor` and meant to be added to the score. `response_lengths` counts response tokens.
    Departure: `factor` (1 in the paper) scales the penalty, as verl's ``penalty_factor``.
    """
    if not 0 < buffer_len <= max_len:
        raise ConfigError(
            f"overlong buffer of {buffer_len} tokens does not fit a {max_len}-token response.",
            hint="Set algorithm.overlong.buffer_len between 1 and the generation length limit "
            "(DAPO: 4096 of 20480).",
        )
    expected = max_len - buffer_len
    lengths = response_lengths.to(torch.float32)
    inside = (expected - lengths) / buffer_len
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), inside)
    penalty = torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)
    return penalty * factor


def groups_with_signal(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """DAPO's dynamic sampling filter: ``[B]`` bool, True for samples whose group's scores are
    not all equal (a group where every response scored the same gives every token advantage 0
    under group-relative estimators, so it only dilutes the batch). Groups of one sample are
    False. No departure; refilling the batch is the rollout scheduler's job.
    """
    groups = groups_of(group_ids, scores.shape[0], scores.device)
    high = torch.full((groups.num,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((groups.num,), torch.inf, dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, groups.inverse, scores, reduce="amax")
    low = low.scatter_reduce(0, groups.inverse, scores, reduce="amin")
    return (high > low)[groups.inverse]
