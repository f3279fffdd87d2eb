"""Token entropy of the policy and the entropy bonus."""

from __future__ import annotations

from typing import Any

import torch

from roll_core.algorithms.aggregation import agg_loss
from roll_core.algorithms.functional import masked_mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: logits ``[B, T, V]`` ->
    ``[B, T]``, computed in float32 as ``logsumexp(z) - sum(softmax(z) * z)``.

    Mask the result with the response mask (or pass it to :func:`entropy_bonus`, which does).
    Memory: the softmax is a second ``[B, T, V]`` tensor; call it on slices of the batch when
    the vocabulary is large.
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_bonus(
    *,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    agg_mode: str = "token-mean",
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy bonus: the loss term ``-coef * aggregate(entropy)`` (maximising entropy).

    The exploration bonus of A3C and PPO (Mnih et al. 2016, arXiv 1602.01783; Schulman et al.
    2017, arXiv 1707.06347, eq. 9), on token entropies ``[B, T]`` from
    :func:`entropy_from_logits`. `agg` takes the global normalisers of
    :func:`~roll_core.algorithms.aggregation.agg_loss`. Metrics: ``actor/entropy`` (mean over
    response tokens, whatever `agg_mode`). No departure.
    """
    value = agg_loss(entropy, response_mask, agg_mode, **agg)
    return -coef * value, {"actor/entropy": float(masked_mean(entropy.detach(), response_mask))}
