"""KL divergence to a reference policy: per-token estimators, used as a reward penalty or as a
loss term, and the fixed / adaptive coefficient controllers.

The estimators follow Schulman's note "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html; no arXiv id). With ``log_probs`` from the policy that
sampled the tokens and ``ref_log_probs`` from the reference, and ``d = ref_logp - logp``:

* ``k1 = -d = logp - ref_logp``: unbiased, high variance, can be negative;
* ``k2 = d**2 / 2``: biased, low variance, never negative;
* ``k3 = exp(d) - d - 1``: unbiased, low variance, never negative (GRPO's estimator, arXiv
  2402.03300, eq. 4);
* ``low_var_k3``: k3 with ``d`` clamped to +-20 and the result clamped to [-10, 10], as verl's
  ``low_var_kl`` (guards against a few tokens with extreme ratios).

All are ``[B, T]`` tensors (mask them yourself, or use :func:`apply_kl_penalty` /
:func:`kl_loss`, which do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from roll_core.algorithms.aggregation import agg_loss
from roll_core.algorithms.registry import unknown_name_error


def _k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def _k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs) ** 2


def _k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    d = ref_log_probs - log_probs
    return torch.exp(d) - d - 1


def _low_var_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    d = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_k3": _low_var_k3,
}
"""Per-token KL estimators by name (the recipe key `algorithm.kl.estimator`)."""


def kl_estimate(
    estimator: str, *, log_probs: torch.Tensor, ref_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token estimate ``[B, T]`` of KL(policy || reference) with the named estimator."""
    if estimator not in KL_ESTIMATORS:
        raise unknown_name_error(
            "KL estimator", estimator, list(KL_ESTIMATORS), key="algorithm.kl.estimator"
        )
    return KL_ESTIMATORS[estimator](log_probs, ref_log_probs)


def apply_kl_penalty(
    *,
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a per-token reward penalty: ``rewards = scores - coef * kl`` on response tokens.

    As in Ziegler et al. 2019 (arXiv 1909.08593) and InstructGPT (arXiv 2203.02155),
    with the penalty spread over tokens (REINFORCE++, arXiv 2501.03262). `log_probs` are the
    behaviour policy's (the old log-probs of the batch), so no gradient flows through the
    penalty.

    Returns ``(token_rewards [B, T], metrics)``: ``actor/reward_kl`` is the batch mean of
    each response's mean per-token KL (the quantity the adaptive controller tracks) and
    ``actor/reward_kl_coef`` the coefficient used.
    """
    m = response_mask.to(token_scores.dtype)
    with torch.no_grad():
        kl = kl_estimate(estimator, log_probs=log_probs, ref_log_probs=ref_log_probs) * m
        rewards = token_scores - coef * kl
        per_seq = kl.sum(-1) / m.sum(-1).clamp(min=1)
        current = per_seq.mean() if per_seq.numel() else torch.zeros(())
    return rewards, {"actor/reward_kl": float(current), "actor/reward_kl_coef": float(coef)}


def kl_loss(
    *,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    estimator: str = "low_var_k3",
    agg_mode: str = "token-mean",
    **agg: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a loss term: ``coef * aggregate(kl)`` with gradient through `log_probs`.

    GRPO (arXiv 2402.03300, eq. 3) adds ``beta * D_KL`` with the k3 estimator to the loss
    instead of the reward. `agg` takes the global normalisers of
    :func:`~roll_core.algorithms.aggregation.agg_loss`. Returns ``(coef * kl, metrics)`` with
    ``actor/kl_loss`` (the aggregated KL before the coefficient) and ``actor/kl_coef``.
    Departure: the GRPO preset uses ``low_var_k3`` (clamped k3, as verl) for stability.
    """
    kl = kl_estimate(estimator, log_probs=log_probs, ref_log_probs=ref_log_probs)
    value = agg_loss(kl, response_mask, agg_mode, **agg)
    return coef * value, {"actor/kl_loss": float(value.detach()), "actor/kl_coef": float(coef)}


class FixedKLController:
    """A constant KL coefficient (the same interface as :class:`AdaptiveKLController`)."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        """The coefficient, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient from :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593).

    After each batch: ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``coef *= 1 + e * n_steps / horizon``: the coefficient grows while the policy drifts further
    than `target` from the reference and shrinks when it stays closer. The paper writes
    ``K_beta`` for ``n_steps / horizon`` (0.1); this follows its released code
    (lm-human-preferences), where `n_steps` is the number of samples in the batch. No departure.
    """

    def __init__(self, coef: float, *, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be positive")
        self.value = float(coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient to the KL measured on the last batch of `n_steps` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The current coefficient, for checkpoints (exact resume)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient from :meth:`state_dict`."""
        self.value = float(state["value"])


def make_kl_controller(
    *, coef: float, target: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """A fixed controller, or an adaptive one when `target` is set."""
    if target is None:
        return FixedKLController(coef)
    return AdaptiveKLController(coef, target=target, horizon=horizon)
