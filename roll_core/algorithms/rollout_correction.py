"""Rollout correction: importance weights and rejection masks for the train-inference mismatch.

The inference engine samples the response tokens from ``pi_rollout`` (its own kernels, precision
and, in async training, possibly older weights); the trainer's old log-probs are ``pi_old``. The
per-token log-ratio ``d = old_logp - rollout_logp`` measures how far apart they are. Everything
here is a pure function of ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``, all
``[B, T]``, with no gradient; it returns weights or masks ``[B, T]`` and metrics named
``rollout_corr/...``.

Sources, followed formula for formula (docs/algorithms.md "Rollout correction" lists every
departure):

* verl's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``, volcengine/verl):
  token / sequence importance weights truncated at ``rollout_is_threshold`` (TIS) or zeroed
  outside a ``"low_high"`` band (IcePop), rejection on a ratio band at token / sequence /
  geometric level (``rollout_rs`` up to 2025-12), rejection on divergence estimates
  ``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*`` (2026-01), the IS metrics of
  ``compute_is_metrics`` and the off-policy metrics ``kl``, ``k3_kl``, ``chi2_token``
  (verl-project/verl commit 1dda039);
* Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
  (fengyao.notion.site/off-policy-rl, no arXiv id): token TIS ``min(rho, C)`` and MIS (tokens
  with ``rho > C`` masked);
* slime's ``examples/train_infer_mismatch_helper/mis.py`` (THUDM/slime): the ``geometric`` level
  of the importance weight (``exp(mean_t d)``).

How the results enter the loss (roll_core/pipelines/rl_iteration.py, as verl does): the weights
multiply each token's policy loss; the rejection mask is multiplied into ``response_mask``, so a
rejected token leaves both the numerator and the denominator of every loss aggregation, and a
row with no kept token is not counted as a sequence (see
:func:`roll_core.algorithms.aggregation.agg_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from roll_core.algorithms.functional import masked_mean, masked_sum
from roll_core.algorithms.registry import unknown_name_error
from roll_core.errors import ConfigError

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-20 before exp (verl's ``SAFETY_BOUND``)."""

LEVELS = ("token", "sequence", "geometric")
"""Aggregation levels of an importance weight or a ratio band."""

DIVERGENCE_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""Divergence rejection criteria (verl's ``rollout_rs`` options, same names)."""

PREFIX = "rollout_corr/"


def _check_level(level: str, key: str) -> None:
    if level not in LEVELS:
        raise unknown_name_error("rollout-correction level", level, list(LEVELS), key=key)


def _check_band(low: float, high: float, what: str) -> None:
    if not (0.0 <= low < high):
        raise ConfigError(
            f"{what}: the band [{low}, {high}] is empty or negative (low must be >= 0 and below "
            "high).",
            hint="Set the lower bound below the upper one (e.g. low 0.5, high 2.0), or leave the "
            "lower bound out to use 1 / high.",
        )


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=-1) > 0


def level_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str):
    """The log-ratio at `level`, ``[B, T]``, not clamped: ``token``: ``d_t``; ``sequence``:
    ``sum_t d_t`` (log of the product of the token ratios); ``geometric``: ``mean_t d_t`` (log
    of their geometric mean); the two sequence levels are broadcast over the row."""
    if level == "token":
        return log_ratio
    m = response_mask.to(log_ratio.dtype)
    per_seq = masked_sum(log_ratio, m, dim=-1)
    if level == "geometric":
        per_seq = per_seq / m.sum(dim=-1).clamp(min=1)
    return per_seq.unsqueeze(-1).expand_as(log_ratio)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> float:
    fill = float("-inf") if largest else float("inf")
    filled = x.masked_fill(~mask.bool(), fill)
    return float(filled.max() if largest else filled.min())


def importance_weights(
    *,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    cap: float | None,
    low: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``pi_old / pi_rollout`` at `level`, truncated at `cap`: ``[B, T]``.

    ``w = min(exp(clamp(level_log_ratio, -20, 20)), cap) * response_mask`` (verl's
    ``compute_rollout_correction_weights``; ``geometric`` from slime). ``cap=None``: no
    truncation. With `low` (IcePop, verl's ``rollout_is_threshold: "low_cap"``) weights outside
    ``[low, cap]`` are set to 0 instead (the token stays in ``response_mask``, so it still
    counts in the loss denominators) and ``rollout_is_oob_ratio`` is their share of the response
    tokens. Metrics, as current verl's ``compute_is_metrics``: ``rollout_is_mean`` (of the
    applied, truncated weights over the response tokens); ``rollout_is_max`` / ``_min``
    (token: of the applied weights over response tokens; sequence levels: ``exp`` of the rows'
    untruncated log-ratios over rows with a response token, clamped at +20 for the max only);
    ``rollout_is_ratio_fraction_high`` / ``_low`` (share of the untruncated token weights, or
    rows, above ``cap`` / below ``low``, or ``1 / cap`` without it); and
    ``rollout_is_eff_sample_size``: ``(sum w)^2 / (n sum w^2)`` over the n response tokens of
    the applied weights ``w`` (0 when every weight is 0).
    Needs at least one response token (:func:`rollout_correction` checks).
    """
    _check_level(level, "algorithm.rollout_correction.is_level")
    if cap is not None and cap <= 0:
        raise ConfigError(
            f"importance-weight cap {cap} must be positive.",
            hint="Set algorithm.rollout_correction.is_cap to a value >= 1 (2.0 is common) or null.",
        )
    if low is not None:
        if cap is None:
            raise ConfigError(
                "an importance-weight lower bound (IcePop) needs an upper bound.",
                hint="Set algorithm.rollout_correction.is_cap (e.g. 5.0) next to is_low.",
            )
        _check_band(low, cap, "algorithm.rollout_correction is_low/is_cap")
    m = response_mask.to(log_ratio.dtype)
    lvl = level_log_ratio(log_ratio.detach(), m, level)
    raw = torch.exp(lvl.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    metrics: dict[str, float] = {}
    if low is not None and cap is not None:
        inside = (raw >= low) & (raw <= cap)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
        metrics["rollout_is_oob_ratio"] = float(masked_mean((~inside).float(), m))
    else:
        weights = raw if cap is None else raw.clamp(max=cap)
    metrics["rollout_is_mean"] = float(masked_mean(weights, m))
    rows = _valid_rows(m)
    seq_log = lvl[:, 0][rows]
    if level == "token":
        metrics["rollout_is_max"] = _masked_extreme(weights, m, largest=True)
        metrics["rollout_is_min"] = _masked_extreme(weights, m, largest=False)
    else:
        metrics["rollout_is_max"] = math.exp(min(float(seq_log.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(float(seq_log.min()))
    if cap is not None:
        floor = 1 / cap if low is None else low
        if level == "token":
            above = masked_mean((raw > cap).float(), m)
            below = masked_mean((raw < floor).float(), m)
        else:
            above = (seq_log > math.log(cap)).float().mean()
            below = (seq_log < math.log(floor)).float().mean()
        metrics["rollout_is_ratio_fraction_high"] = float(above)
        metrics["rollout_is_ratio_fraction_low"] = float(below)
    normalised = weights / (masked_mean(weights, m) + 1e-8)
    second = float(masked_mean(normalised.square(), m))
    # every weight zeroed (IcePop): no effective sample (verl divides by zero there)
    metrics["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    return weights.detach(), {PREFIX + k: v for k, v in metrics.items()}


def ratio_band_mask(
    *,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """Keep-mask ``[B, T]`` (1 keep, 0 reject) of a ratio band at `level`: a token (``token``)
    or a whole row (``sequence``, ``geometric``) is kept when
    ``low <= exp(clamp(level_log_ratio, -20, 20)) <= high`` (verl's ``rollout_rs`` with
    ``rollout_rs_threshold_lower`` / ``rollout_rs_threshold``, up to 2025-12)."""
    _check_level(level, "algorithm.rollout_correction.rs_level")
    _check_band(low, high, "algorithm.rollout_correction rs_low/rs_high")
    lvl = level_log_ratio(log_ratio.detach(), response_mask, level)
    ratio = torch.exp(lvl.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return ((ratio >= low) & (ratio <= high)).to(log_ratio.dtype)


def _token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    d = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -d  # log(pi_rollout / pi_old): KL(rollout || old) sampled under rollout
    if estimator == "k2":
        return 0.5 * d.square()
    return torch.exp(d) - 1.0 - d  # k3


def divergence_mask(
    *,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    option: str,
    high: float,
    low: float | None = None,
) -> torch.Tensor:
    """Keep-mask ``[B, T]`` of one divergence criterion (verl's ``rollout_rs`` options, 2026-01).

    Per token, with ``d`` clamped to +-20: ``k1 = -d``, ``k2 = d^2 / 2``,
    ``k3 = exp(d) - 1 - d``. ``token_kX`` tests each token; ``seq_sum_kX`` / ``seq_mean_kX`` /
    ``seq_max_kX`` test the sum / mean / max of a row's tokens and keep or reject the whole row.
    k2 and k3 are kept when the statistic is ``<= high``; k1 options are kept when
    ``log(low) <= statistic <= log(high)`` (verl's ``"low_high"`` ratio bounds; ``low`` defaults
    to ``1 / high``). A row without response tokens has statistic 0.
    """
    if option not in DIVERGENCE_OPTIONS:
        raise unknown_name_error(
            "divergence rejection option",
            option,
            list(DIVERGENCE_OPTIONS),
            key="algorithm.rollout_correction.rs_divergence[].option",
        )
    where, estimator = option.rsplit("_", 1)
    k1 = estimator == "k1"
    if k1:
        low = 1.0 / high if low is None else low
        _check_band(low, high, f"rs_divergence {option}")
        if low <= 0:
            raise ConfigError(
                f"rs_divergence {option}: the lower bound must be positive (it is a ratio).",
                hint="Set `low` to a positive value such as 0.5, or leave it out (1 / high).",
            )
    elif low is not None:
        raise ConfigError(
            f"rs_divergence {option}: `low` only applies to k1 options (k2 and k3 are never "
            "negative, so only an upper bound makes sense).",
            hint=f"Remove `low` from the {option} entry.",
        )
    m = response_mask.to(log_ratio.dtype)
    stat = _token_divergence(log_ratio.detach(), estimator)
    if where == "seq_sum":
        stat = masked_sum(stat, m, dim=-1).unsqueeze(-1)
    elif where == "seq_mean":
        stat = masked_mean(stat, m, dim=-1).unsqueeze(-1)
    elif where == "seq_max":
        peak = stat.masked_fill(~m.bool(), float("-inf")).max(dim=-1).values
        stat = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak).unsqueeze(-1)
    lo, hi = (math.log(low), math.log(high)) if low is not None else (-math.inf, high)
    keep = (stat >= lo) & (stat <= hi)
    return keep.expand_as(log_ratio).to(log_ratio.dtype)


def mismatch_metrics(
    *, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler is from the trainer, over the response tokens.

    ``kl = mean(rollout_logp - old_logp)`` (k1 estimate of KL(pi_rollout || pi_old) under the
    rollout samples) and ``k3_kl = mean(exp(d) - d - 1)`` (k3 estimate of the same KL; verl's
    ``kl`` and ``k3_kl``, no clamp); ``chi2_token = mean(rho^2) - 1`` (verl's); roll's own:
    ``ratio_mean`` / ``_min`` / ``_max`` of the token ratio ``rho = exp(clamp(d, -20, 20))`` and
    its normalised effective sample size ``ess = (sum rho)^2 / (n sum rho^2)``.
    """
    m = response_mask.to(old_log_probs.dtype)
    d = (old_log_probs - rollout_log_probs).detach()
    rho = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    n = m.sum().clamp(min=1)
    total = masked_sum(rho, m)
    metrics = {
        "kl": float(masked_mean(-d, m)),
        "k3_kl": float(masked_mean(torch.exp(d) - d - 1, m)),
        "chi2_token": float(masked_mean(rho.square(), m) - 1),
        "ratio_mean": float(total / n),
        "ratio_min": _masked_extreme(rho, m, largest=False),
        "ratio_max": _masked_extreme(rho, m, largest=True),
        "ess": float(total.square() / (n * masked_sum(rho.square(), m))),
    }
    return {PREFIX + k: v for k, v in metrics.items()}


def _rejection_metrics(name: str, keep: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    rejected = (1 - keep) * m
    rows = _valid_rows(m)
    seq = (rejected.sum(-1) > 0)[rows].float().mean() if rows.any() else torch.tensor(0.0)
    return {
        f"{PREFIX}rollout_rs{name}_masked_fraction": float(masked_mean(1 - keep, m)),
        f"{PREFIX}rollout_rs{name}_seq_masked_fraction": float(seq),
    }


def rollout_correction(
    *,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    is_level: str | None = None,
    is_cap: float | None = None,
    is_low: float | None = None,
    rs_level: str | None = None,
    rs_low: float | None = None,
    rs_high: float | None = None,
    rs_divergence: Sequence[tuple[str, float | None, float]] = (),
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Importance weights, the rejected-token mask and the metrics of one rollout batch.

    Args:
        old_log_probs: ``[B, T]`` the trainer's log-probs of the sampled tokens (``pi_old``).
        rollout_log_probs: ``[B, T]`` the sampler's log-probs of the same tokens.
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        is_level: ``token`` / ``sequence`` / ``geometric`` importance weights, None: none.
        is_cap: truncation of the weights (TIS); None: untruncated.
        is_low: with `is_cap`, weights outside ``[is_low, is_cap]`` become 0 (IcePop).
        rs_level: ratio-band rejection at ``token`` / ``sequence`` / ``geometric`` level.
        rs_low, rs_high: the band (``rs_low`` None: ``1 / rs_high``).
        rs_divergence: ``(option, low, high)`` divergence criteria (:func:`divergence_mask`).

    Returns:
        ``(weights or None, new_response_mask, metrics)``. Every criterion must pass for a token
        to stay; weights are computed on the original mask (as verl). Metrics: those of
        :func:`mismatch_metrics` and :func:`importance_weights`, and ``rollout_rs_masked_fraction``
        (rejected share of the response tokens) and ``rollout_rs_seq_masked_fraction`` (share of
        the rows with a response token that lost at least one), also per criterion
        (``rollout_rs_<level or option>_...``). An empty mask gives no metrics.
    """
    m = response_mask.to(old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs).detach()
    weights = None
    if not bool(m.any()):
        return (torch.zeros_like(m) if is_level else None), response_mask, {}
    metrics = mismatch_metrics(
        old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, response_mask=m
    )
    if is_level is not None:
        weights, is_metrics = importance_weights(
            log_ratio=log_ratio, response_mask=m, level=is_level, cap=is_cap, low=is_low
        )
        metrics |= is_metrics
    keep = torch.ones_like(m)
    criteria: list[tuple[str, torch.Tensor]] = []
    if rs_level is not None:
        if rs_high is None:
            raise ConfigError(
                "rs_level is set but rs_high is not.",
                hint="Set algorithm.rollout_correction.rs_high (e.g. 2.0).",
            )
        low = 1.0 / rs_high if rs_low is None else rs_low
        band = ratio_band_mask(
            log_ratio=log_ratio, response_mask=m, level=rs_level, low=low, high=rs_high
        )
        criteria.append((rs_level, band))
    for option, low_k, high_k in rs_divergence:
        criteria.append(
            (
                option,
                divergence_mask(
                    log_ratio=log_ratio, response_mask=m, option=option, low=low_k, high=high_k
                ),
            )
        )
    for name, crit in criteria:
        metrics |= _rejection_metrics(f"_{name}", crit, m)
        keep = keep * crit
    metrics |= _rejection_metrics("", keep, m)
    new_mask = (response_mask * keep.to(response_mask.dtype)).to(response_mask.dtype)
    return weights, new_mask, metrics
