"""The critic's loss (PPO with ``adv_estimator: gae``)."""

from __future__ import annotations

from typing import Any

import torch

from roll_core.algorithms.aggregation import agg_loss
from roll_core.algorithms.functional import masked_mean, masked_var


def value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: float | None = None,
    agg_mode: str = "token-mean",
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    PPO's value clipping (OpenAI baselines' ppo2; studied in Engstrom et al. 2020, arXiv
    2005.12729, and Andrychowicz et al. 2020, arXiv 2006.05990): the new prediction
    `values` ``[B, T]`` may move at most `clip` from `old_values` before the loss stops
    rewarding the move. `returns` ``[B, T]`` are the targets from the ``gae`` estimator.
    ``clip=None`` gives the plain squared error ``0.5 * (V - R)^2``.

    Metrics: ``critic/vf_loss``, ``critic/vf_clipfrac`` (tokens where the clipped term is the
    larger), ``critic/vpred_mean``. No departure.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss_mat = unclipped
        clipfrac = torch.zeros(())
    else:
        if clip <= 0:
            raise ValueError(f"value clip must be positive, got {clip}")
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns) ** 2
        loss_mat = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    loss = 0.5 * agg_loss(loss_mat, response_mask, agg_mode, **agg)
    return loss, {
        "critic/vf_loss": float(loss.detach()),
        "critic/vf_clipfrac": float(clipfrac),
        "critic/vpred_mean": float(masked_mean(values.detach(), response_mask)),
    }


def explained_variance(
    *, values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the masked tokens (a scalar).

    How much of the returns' variance the critic's predictions account for: 1 is a perfect
    critic, 0 is no better than predicting the mean, negative is worse than that. Variances are
    the unbiased masked ones; when the returns do not vary the result is 0 (nothing to
    explain) instead of NaN. As logged by OpenAI baselines and verl (``vf_explained_var``).
    """
    var_returns = masked_var(returns, response_mask)
    if float(var_returns) <= 0:
        return torch.zeros((), dtype=returns.dtype)
    return 1 - masked_var(returns - values, response_mask) / var_returns
