"""Policy losses: log-probabilities and advantages -> ``(loss, metrics)``.

Call :func:`policy_loss` with the loss's name (registry :data:`POLICY_LOSSES`). Inputs, all
``[B, T]``:

* ``log_probs``: log-probabilities of the response tokens under the policy being trained
  (carries the gradient);
* ``old_log_probs``: the same tokens under the policy before this step's updates (computed by
  the train engine, no gradient);
* ``advantages``: from :mod:`roll_core.algorithms.advantages`;
* ``response_mask``: 1 on response tokens, 0 on padding;
* ``infer_log_probs`` (optional): the tokens' log-probabilities reported by the inference
  engine that sampled them (the behaviour policy of ``decoupled_ppo``).

Each registered loss returns a per-token loss matrix; :func:`policy_loss` then multiplies it
by the rollout correction's importance weights when given
(:mod:`roll_core.algorithms.rollout_correction`), aggregates with ``agg_mode``
(:mod:`roll_core.algorithms.aggregation`) and returns metrics with namespaced keys
(``actor/pg_loss``, ``actor/clipfrac``, ``actor/ppo_kl``, ...). Token metrics are means over
this batch's response tokens.

The REINFORCE-style losses (``cispo``, ``topr``, ``pg``) are written
``-A * sg(w) * exp(logp - sg(logp))``: its gradient is the paper's ``-A * w * grad(logp)`` and
its value is ``-A * w``, on the same scale as the PPO surrogate (the papers' ``-A * w * logp``
has the same gradient but a value that moves with ``logp``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from roll_core.algorithms.aggregation import agg_loss
from roll_core.algorithms.functional import masked_mean, masked_sum
from roll_core.algorithms.registry import Registry
from roll_core.errors import ConfigError

TokenLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[TokenLossFn] = Registry("policy loss", key="algorithm.policy_loss")
"""Per-token policy losses by name: fn(log_probs=, old_log_probs=, advantages=,
response_mask=, **params) -> (loss [B, T], token metrics)."""

LOG_RATIO_LIMIT = 20.0
"""Log importance ratios are clamped to +-20 before exp (as in verl) so exp never overflows."""


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ConfigError(
            f"clip range [1 - {clip_low}, 1 + {clip_high}] is not valid.",
            hint="Set algorithm.clip_low between 0 and 1 and algorithm.clip_high >= 0.",
        )


def _reinforce_term(advantages: torch.Tensor, weight: torch.Tensor, log_probs: torch.Tensor):
    """``-A * sg(w) * exp(logp - sg(logp))``: value ``-A*w``, gradient ``-A*w*grad(logp)``."""
    return -advantages * weight.detach() * torch.exp(log_probs - log_probs.detach())


@POLICY_LOSSES.register("ppo")
def ppo(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7) with asymmetric
    clip-higher (DAPO, Yu et al. 2025, arXiv 2503.14476, sec. 3.1) and optional dual clip
    (Ye et al. 2019, arXiv 1912.09729).

    ``r = exp(logp - old_logp)``; ``loss = max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high))``;
    with ``clip_c`` (> 1), tokens with ``A < 0`` use ``min(loss, -A*clip_c)``, which bounds the
    loss when r is very large.

    Metrics: ``actor/clipfrac`` (tokens where the clipped term is the larger one) and, with
    dual clip, ``actor/clipfrac_lower`` (negative-advantage tokens bounded by ``clip_c``).
    Departure: the log-ratio is clamped to +-20 before exp (as in verl).
    """
    _check_clip(clip_low, clip_high)
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"actor/clipfrac": masked_mean((clipped > unclipped).float(), response_mask)}
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ConfigError(
                f"dual-clip constant {clip_c} must be greater than 1.",
                hint="Set algorithm.dual_clip_c to a value > 1 (3.0 is common) or null.",
            )
        bound = -advantages * clip_c
        lower = (loss > bound) & (advantages < 0)
        metrics["actor/clipfrac_lower"] = masked_mean(lower.float(), response_mask)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071, including its
    GSPO-token form).

    The importance ratio is the length-normalised sequence ratio
    ``s_i = exp(mean_t (logp - old_logp))``, shared by all tokens of response i and clipped to
    ``[1 - clip_low, 1 + clip_high]`` PPO-style. Written token-wise as
    ``s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))`` so that a per-token advantage works too
    (GSPO-token); with the same advantage on every token and ``seq-mean-token-mean``
    aggregation (the gspo preset) this is exactly the sequence-level objective.

    Departure: the log of ``s_i,t`` is clamped at 10 (as in verl).
    """
    _check_clip(clip_low, clip_high)
    m = response_mask.to(log_probs.dtype)
    seq_log_ratio = masked_sum(log_probs - old_log_probs, m, dim=-1) / m.sum(-1).clamp(min=1)
    log_s = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=10.0))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {
        "actor/clipfrac": masked_mean((clipped > unclipped).float(), m),
        "actor/seq_ratio_mean": masked_mean(s.detach(), m),
    }


@POLICY_LOSSES.register("cispo")
def cispo(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, sec. 3.1, eq. 4).

    REINFORCE with a clipped, stop-gradient importance weight: the gradient is
    ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * grad(logp)``. Unlike PPO no token's
    gradient is dropped, only down-weighted. ``clip_low = 1`` (the default) means no lower
    bound, as the paper does; ``actor/clipfrac`` is the share of tokens whose weight was
    clipped.

    Departure: the loss value is ``-A * clip(r)`` (same gradient as the paper's
    ``-sg(clip(r)) * A * logp``, see the module docstring). The paper does not publish its
    ``clip_high``; 0.28 is a common choice in open implementations.
    """
    _check_clip(clip_low, clip_high)
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _reinforce_term(advantages, weight, log_probs)
    was_clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return loss, {"actor/clipfrac": masked_mean(was_clipped.float(), response_mask)}


@POLICY_LOSSES.register("topr")
def topr(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286).

    Positive-advantage tokens get plain REINFORCE (weight 1, no importance sampling: SFT on
    good responses); negative-advantage tokens get the truncated sequence importance weight
    ``clip(pi(y)/mu(y), 0, 1)``, where ``pi(y)/mu(y) = exp(sum_t (logp - old_logp))`` is the
    ratio of the whole response, so pushing down a bad response stops once it is already less
    likely than when it was sampled.

    Metrics: ``actor/clipfrac`` is the share of negative-advantage tokens whose weight was
    truncated below 1. Departure: the sign is taken per token from the advantage (for outcome
    rewards every token of a response has the same sign, as in the paper, where it is the sign
    of the return).
    """
    m = response_mask.to(log_probs.dtype)
    seq_log_ratio = masked_sum(log_probs - old_log_probs, m, dim=-1).detach()
    seq_weight = torch.exp(seq_log_ratio.clamp(max=0.0)).unsqueeze(-1).expand_as(log_probs)
    negative = advantages < 0
    weight = torch.where(negative, seq_weight, torch.ones_like(seq_weight))
    loss = _reinforce_term(advantages, weight, log_probs)
    truncated = negative & (seq_log_ratio.unsqueeze(-1) > 0)
    return loss, {"actor/clipfrac": masked_mean(truncated.float(), m)}


@POLICY_LOSSES.register("pg")
def pg(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Vanilla (on-policy) policy gradient, REINFORCE (Williams 1992, Machine Learning
    8:229-256; no arXiv id): gradient ``-A * grad(logp)``, no importance ratio, no clipping.

    ``old_log_probs`` is not used (it only feeds the ``actor/ppo_kl`` metric): use this loss
    when every batch gets exactly one optimizer step. Departure: the loss value is ``-A`` (see
    the module docstring).
    """
    return _reinforce_term(advantages, torch.ones_like(log_probs), log_probs), {}


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    behaviour_log_probs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behaviour_cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298, sec. 5.1, eq. 5): the proximal
    policy that the clip trusts is separate from the behaviour policy that sampled the tokens.

    ``old_log_probs`` are the proximal policy's (the trainer's log-probs before this step's
    updates); ``behaviour_log_probs`` are the sampler's (possibly several versions older in
    async training). ``w = exp(old_logp - behaviour_logp)`` (no gradient) corrects for the
    off-policy sampling; ``r = exp(logp - old_logp)`` is clipped as in PPO:
    ``loss = w * max(-A*r, -A*clip(r, 1 - clip_low, 1 + clip_high))``. Tokens whose ``w``
    exceeds ``behaviour_cap`` get weight 0 (as AReaL masks them); ``math.inf``: no cap (through
    :func:`policy_loss` a None argument means "the default", as for every registered loss, so
    None keeps the cap of 5). Not to be combined with the rollout correction's importance
    weights (``algorithm.tis_cap`` included): ``w`` already is the train/inference correction
    (the recipe schema rejects the pair). Without
    ``behaviour_log_probs`` the behaviour policy is the proximal one (``w = 1``: plain PPO).

    Metrics: ``actor/clipfrac``, ``actor/behav_weight_mean`` / ``_max`` (over kept tokens),
    ``actor/behav_capfrac`` (tokens masked by the cap). Departure: log-ratios clamped to +-20.
    """
    _check_clip(clip_low, clip_high)
    if behaviour_log_probs is None:
        behaviour_log_probs = old_log_probs
    log_w = (old_log_probs - behaviour_log_probs).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    weight = torch.exp(log_w)
    capped = weight > behaviour_cap
    weight = torch.where(capped, torch.zeros_like(weight), weight)
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = weight * torch.maximum(unclipped, clipped)
    kept = response_mask * (~capped).to(response_mask.dtype)
    return loss, {
        "actor/clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "actor/behav_weight_mean": masked_mean(weight, kept),
        "actor/behav_weight_max": (weight * kept).max(),
        "actor/behav_capfrac": masked_mean(capped.float(), response_mask),
    }


def _check_single_correction(name: str, rollout_is_weights: torch.Tensor | None) -> None:
    """decoupled_ppo's behaviour weight and the rollout correction's importance weights are
    both pi_old / pi_infer: the two together would apply it twice."""
    if rollout_is_weights is not None and name == "decoupled_ppo":
        raise ValueError(
            "rollout-correction importance weights with decoupled_ppo would weight every token "
            "by pi_old / pi_infer twice: use one of them"
        )


def policy_loss(
    name: str,
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg_mode: str = "token-mean",
    infer_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    max_len: int | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    **params: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss `name` aggregated to a scalar, and its metrics.

    Args:
        name: a registered loss: ``ppo``, ``decoupled_ppo``, ``gspo``, ``cispo``, ``topr``,
            ``pg``.
        log_probs, old_log_probs, advantages, response_mask: ``[B, T]`` (module docstring).
        agg_mode: loss aggregation (:data:`~roll_core.algorithms.aggregation.LOSS_AGG_MODES`).
        infer_log_probs: ``[B, T]`` log-probs from the inference engine (the behaviour
            policy of ``decoupled_ppo``).
        rollout_is_weights: ``[B, T]`` importance weights of the rollout correction
            (:mod:`roll_core.algorithms.rollout_correction`, computed once per batch): every
            token's loss is multiplied by its weight before aggregation (as verl; token-level
            TIS, the recipe's ``algorithm.tis_cap``, arrives here too); the
            aggregation's denominators do not change. Its rejection acts through
            ``response_mask`` (rejected tokens are 0 there).
        max_len, global_num_tokens, global_num_seqs: see
            :func:`~roll_core.algorithms.aggregation.agg_loss`.
        **params: the loss's own parameters (``clip_low``, ``clip_high``, ``clip_c``); one
            call site can pass them all, each loss takes the ones it has; None means default.

    Returns:
        ``(loss, metrics)``: the scalar loss (with gradient) and floats ``actor/pg_loss``,
        ``actor/ppo_kl`` (mean of ``old_logp - logp``) and the loss's own metrics.
    """
    fn = POLICY_LOSSES.get(name)
    _check_single_correction(name, rollout_is_weights)
    inputs = dict(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        response_mask=response_mask,
        behaviour_log_probs=infer_log_probs,  # the behaviour policy (decoupled_ppo)
        **params,
    )
    loss_mat, token_metrics = POLICY_LOSSES.call(fn, name, inputs)
    metrics = {k: float(v) for k, v in token_metrics.items()}
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    loss = agg_loss(
        loss_mat,
        response_mask,
        agg_mode,
        max_len=max_len,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )
    ppo_kl = masked_mean((old_log_probs - log_probs).detach(), response_mask)
    metrics["actor/pg_loss"] = float(loss.detach())
    metrics["actor/ppo_kl"] = float(ppo_kl)
    return loss, metrics
