"""The `algorithm:` section of RL recipes: estimator, loss, KL, normalisation, presets.

A preset is data, not a code path: ``algorithm: {preset: dapo}`` fills the keys listed in
:data:`PRESETS` and any key the recipe (or a command-line override) sets wins, section by
section (``algorithm.kl.coef`` can be overridden without restating ``algorithm.kl.estimator``).
The resolved values, not the preset name alone, are what the run directory's ``config.yaml``
records. Names of estimators, losses and modes are Literals so that `roll schema` lists them; a
test keeps them equal to the registries in :mod:`roll_core.algorithms`.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from roll_core.config.on_policy_distill import OnPolicyDistillConfig
from roll_core.config.schema import Strict

AdvEstimatorName = Literal[
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
]
PolicyLossName = Literal["ppo", "gspo", "cispo", "topr", "pg", "decoupled_ppo"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLEstimatorName = Literal["k1", "k2", "k3", "low_var_k3"]
PresetName = Literal[
    "ppo",
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "reinforce_plus_plus",
    "rloo",
    "topr",
    "cispo",
    "lite_ppo",
    "raft_plus_plus",
]

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Estimators that compare the samples of one prompt: they need two or more per prompt."""


class KLConfig(Strict):
    """KL divergence to the reference model (a reference is only built when `coef` > 0)."""

    coef: float = Field(
        default=0.0,
        ge=0,
        description="KL coefficient (0: no KL and no reference model). The initial value "
        "when `target` is set.",
    )
    estimator: KLEstimatorName = Field(
        default="low_var_k3",
        description="Per-token estimator: `k1` = logp - ref_logp, `k2` = (logp - ref_logp)^2 "
        "/ 2, `k3` = exp(ref_logp - logp) - (ref_logp - logp) - 1, `low_var_k3` = k3 clamped "
        "to [-10, 10].",
    )
    use_as: Literal["reward", "loss"] = Field(
        default="loss",
        description="`reward`: subtract coef * KL from every token's reward (PPO, "
        "REINFORCE++); `loss`: add coef * KL to the policy loss (GRPO).",
    )
    target: float | None = Field(
        default=None,
        gt=0,
        description="Adaptive coefficient (Ziegler et al. 2019): the KL per token to steer "
        "towards; the coefficient grows when the measured KL is above it. Null: fixed `coef`. "
        "Only with `use_as: reward`.",
    )
    horizon: int = Field(
        default=10000,
        ge=1,
        description="Adaptive coefficient: samples over which the coefficient may change by "
        "at most 20%.",
    )

    @model_validator(mode="after")
    def _adaptive_needs_reward(self) -> KLConfig:
        if self.target is not None and self.use_as != "reward":
            raise ValueError(
                "target (the adaptive KL coefficient) only works with use_as: reward; "
                "set use_as: reward or remove target"
            )
        if self.target is not None and self.coef == 0:
            raise ValueError("target is set but coef is 0: set coef to the initial coefficient")
        return self


class ScoreConfig(Strict):
    """Normalising and clipping the per-sample scores before advantages are computed."""

    normalize: Literal["none", "batch", "group", "running"] = Field(
        default="none",
        description="`batch`: (s - mean) / std over the batch; `group`: over each prompt's "
        "samples; `running`: over every score seen so far (checkpointed); `none`: raw scores.",
    )
    clip: float | None = Field(
        default=None, gt=0, description="Clamp scores to [-clip, clip] (null: no clipping)."
    )


class AdvantageConfig(Strict):
    """Post-processing of the advantages returned by the estimator."""

    whiten: bool = Field(
        default=False,
        description="Whiten advantages over every response token of the batch (mean 0, std 1).",
    )
    clip: float | None = Field(
        default=None,
        gt=0,
        description="Clamp advantages to [-clip, clip], after whitening (null: no clipping).",
    )


class ValueConfig(Strict):
    """The critic's loss (only with `adv_estimator: gae`)."""

    clip: float | None = Field(
        default=0.2,
        gt=0,
        description="PPO value clipping: the new value may move at most this far from the old "
        "one before the loss stops rewarding the move (null: plain squared error).",
    )


class OverlongConfig(Strict):
    """Responses cut off at the generation length limit (DAPO)."""

    mode: Literal["none", "filter", "penalty"] = Field(
        default="none",
        description="`filter`: truncated responses get no loss; `penalty`: DAPO's soft "
        "length penalty in the last `buffer_len` tokens before the limit; `none`: neither.",
    )
    buffer_len: int | None = Field(
        default=None,
        ge=1,
        description="Penalty: length of the soft-penalty zone in tokens (null: a fifth of the "
        "generation length limit; DAPO used 4096 of 20480).",
    )
    penalty_factor: float = Field(
        default=1.0,
        gt=0,
        description="Penalty: the reward lost by a response that reaches the limit.",
    )

    def resolved_buffer_len(self, max_len: int) -> int:
        """`buffer_len`, or a fifth of `max_len` (at least 1) when unset."""
        return self.buffer_len if self.buffer_len is not None else max(1, max_len // 5)


CorrectionLevel = Literal["token", "sequence", "geometric"]
DivergenceOption = Literal[
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
]
CorrectionPresetName = Literal[
    "token_tis",
    "seq_tis",
    "token_icepop",
    "seq_tis_rs",
    "geo_rs",
    "geo_rs_seq_tis",
    "geo_rs_token_tis",
    "k3_rs",
    "k3_rs_seq_tis",
    "k3_rs_token_tis",
    "token_mis",
]

_GEO_RS = [{"option": "seq_mean_k1", "low": 0.999, "high": 1.001}]
_K3_RS = [{"option": "seq_mean_k3", "high": 0.01}]
CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "token_tis": {"is_level": "token", "is_cap": 2.0},
    "seq_tis": {"is_level": "sequence", "is_cap": 2.0},
    "token_icepop": {"is_level": "token", "is_cap": 5.0, "is_low": 0.5},
    "seq_tis_rs": {
        "is_level": "sequence",
        "is_cap": 2.0,
        "rs_divergence": [{"option": "seq_sum_k1", "low": 0.5, "high": 2.0}],
    },
    "geo_rs": {"rs_divergence": _GEO_RS},
    "geo_rs_seq_tis": {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": _GEO_RS},
    "geo_rs_token_tis": {"is_level": "token", "is_cap": 2.0, "rs_divergence": _GEO_RS},
    "k3_rs": {"rs_divergence": _K3_RS},
    "k3_rs_seq_tis": {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": _K3_RS},
    "k3_rs_token_tis": {"is_level": "token", "is_cap": 2.0, "rs_divergence": _K3_RS},
    "token_mis": {
        "is_level": "token",
        "is_cap": None,
        "rs_level": "token",
        "rs_low": 0.0,
        "rs_high": 2.0,
    },
}
"""Rollout-correction preset -> the keys it sets (docs/algorithms.md "Rollout correction")."""


class DivergenceBand(Strict):
    """One divergence rejection criterion (verl's `rollout_rs` option and its threshold)."""

    option: DivergenceOption = Field(
        description="`token_k1|k2|k3` (each token), `seq_sum_*`, `seq_mean_*` (sum / mean over "
        "a response's tokens), `seq_max_k2|k3` (its largest token value): the whole response "
        "is rejected when the sequence statistic leaves the band. Per token, with d = old_logp "
        "- rollout_logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d."
    )
    high: float = Field(
        gt=0,
        description="Upper bound: k2/k3 statistics above it are rejected; for k1 options the "
        "statistic must be <= log(high).",
    )
    low: float | None = Field(
        default=None,
        gt=0,
        description="k1 options only: the statistic must be >= log(low) (null: 1 / high).",
    )

    @model_validator(mode="after")
    def _band(self) -> DivergenceBand:
        if not self.option.endswith("k1") and self.low is not None:
            raise ValueError(
                f"low only applies to k1 options ({self.option} is never negative): remove low"
            )
        if self.low is not None and self.low >= self.high:
            raise ValueError(
                f"the band low {self.low} >= high {self.high} keeps nothing: set low below high"
            )
        return self


class RolloutCorrectionConfig(Strict):
    """Correction for the mismatch between the sampler (inference engine) and the trainer.

    The importance weight ``pi_old / pi_rollout`` (trainer's old log-probs against the
    sampler's) weights each token's loss (IS); rejection (RS) masks tokens or whole responses
    whose ratio or divergence leaves a band. Mismatch metrics (`rollout_corr/...`) are logged
    every step, also with an empty section. Needs the trainer's old log-probs before the
    update, so `trainer.old_log_probs: auto` computes them. Presets and the mapping to verl's
    keys: docs/algorithms.md "Rollout correction".
    """

    preset: CorrectionPresetName | None = Field(
        default=None,
        description="token_tis, seq_tis, token_icepop, seq_tis_rs, geo_rs, geo_rs_seq_tis, "
        "geo_rs_token_tis, k3_rs, k3_rs_seq_tis, k3_rs_token_tis (verl's decoupled-mode "
        "presets), token_mis (Yao et al.); keys set here override it (a list such as "
        "rs_divergence replaces the preset's whole list).",
    )
    is_level: CorrectionLevel | None = Field(
        default=None,
        description="Importance weight per `token`, per `sequence` (product of the token "
        "ratios) or `geometric` (their geometric mean, one per sequence); null: no weights "
        "(verl: rollout_is).",
    )
    is_cap: float | None = Field(
        default=2.0,
        gt=0,
        description="Truncate the weights at this value (TIS; verl: rollout_is_threshold); "
        "null: untruncated (MIS: combine with a rejection band).",
    )
    is_low: float | None = Field(
        default=None,
        gt=0,
        description="IcePop: weights outside [is_low, is_cap] become 0 instead of being "
        "truncated (the token stays in the loss denominators; verl: rollout_is_threshold "
        '"<is_low>_<is_cap>"); null: truncate at is_cap.',
    )
    rs_level: CorrectionLevel | None = Field(
        default=None,
        description="Reject tokens (`token`) or whole responses (`sequence`, `geometric`) whose "
        "ratio at that level leaves [rs_low, rs_high] (verl: rollout_rs); null: off.",
    )
    rs_high: float | None = Field(
        default=None, gt=0, description="Upper ratio bound (verl: rollout_rs_threshold)."
    )
    rs_low: float | None = Field(
        default=None,
        ge=0,
        description="Lower ratio bound (null: 1 / rs_high; 0: no lower bound; verl: "
        "rollout_rs_threshold_lower).",
    )
    rs_divergence: list[DivergenceBand] = Field(
        default_factory=list,
        description="Divergence criteria, all must pass (verl: the comma list of rollout_rs "
        "options and rollout_rs_threshold).",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        named = {"is_level": get_args(CorrectionLevel), "rs_level": get_args(CorrectionLevel)}
        for key, valid in named.items():
            value = data.get(key)
            if isinstance(value, str) and value not in valid:
                raise ValueError(
                    f"{key}: unknown level {value!r}; {_did_you_mean(value, valid)}"
                    f"valid: {', '.join(valid)}"
                )
        options = get_args(DivergenceOption)
        for i, band in enumerate(data.get("rs_divergence") or []):
            value = band.get("option") if isinstance(band, dict) else None
            if isinstance(value, str) and value not in options:
                raise ValueError(
                    f"rs_divergence[{i}].option: unknown option {value!r}; "
                    f"{_did_you_mean(value, options)}valid: {', '.join(options)}"
                )
        name = data.get("preset")
        if name is None:
            return data
        if name not in CORRECTION_PRESETS:
            valid = tuple(CORRECTION_PRESETS)
            raise ValueError(
                f"unknown preset {name!r}; {_did_you_mean(name, valid)}"
                f"valid presets: {', '.join(valid)}"
            )
        return {**CORRECTION_PRESETS[name], **data}

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrectionConfig:
        # the default cap is what a resolved config.yaml records, so only another value errs
        if self.is_level is None and (self.is_cap != 2.0 or self.is_low is not None):
            raise ValueError(
                "is_cap/is_low are set but is_level is not: set is_level or remove them"
            )
        if self.is_low is not None:
            if self.is_cap is None:
                raise ValueError("is_low (IcePop) needs an upper bound: set is_cap (e.g. 5.0)")
            if self.is_low >= self.is_cap:
                raise ValueError(
                    f"the IcePop band is_low {self.is_low} >= is_cap {self.is_cap} zeroes every "
                    "weight: set is_low below is_cap"
                )
        if self.rs_level is None and (self.rs_high is not None or self.rs_low is not None):
            raise ValueError("rs_high/rs_low are set but rs_level is not: set rs_level")
        if self.rs_level is not None:
            if self.rs_high is None:
                raise ValueError(f"rs_level {self.rs_level} needs rs_high (e.g. 2.0)")
            low = 1.0 / self.rs_high if self.rs_low is None else self.rs_low
            if low >= self.rs_high:
                raise ValueError(
                    f"the band rs_low {low} >= rs_high {self.rs_high} rejects every token: set "
                    "rs_low below rs_high"
                )
        return self

    @property
    def resolved_rs_low(self) -> float | None:
        """`rs_low`, or 1 / `rs_high` when unset (None without a ratio band)."""
        if self.rs_high is None:
            return None
        return 1.0 / self.rs_high if self.rs_low is None else self.rs_low

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`roll_core.algorithms.rollout_correction` (besides the
        tensors)."""
        return {
            "is_level": self.is_level,
            "is_cap": self.is_cap,
            "is_low": self.is_low,
            "rs_level": self.rs_level,
            "rs_low": self.resolved_rs_low,
            "rs_high": self.rs_high,
            "rs_divergence": [(b.option, b.low, b.high) for b in self.rs_divergence],
        }


PRESETS: dict[str, dict[str, Any]] = {
    "ppo": {
        "adv_estimator": "gae",
        "gamma": 1.0,
        "lam": 0.95,
        "policy_loss": "ppo",
        "loss_agg_mode": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "advantage": {"whiten": True},
        "value": {"clip": 0.2},
        "kl": {"coef": 0.001, "estimator": "k1", "use_as": "reward"},
    },
    "grpo": {
        "adv_estimator": "grpo",
        "norm_adv_by_std": "group",
        "policy_loss": "ppo",
        "loss_agg_mode": "seq-mean-token-mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl": {"coef": 0.04, "estimator": "low_var_k3", "use_as": "loss"},
    },
    "dr_grpo": {
        "adv_estimator": "dr_grpo",
        "policy_loss": "ppo",
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl": {"coef": 0.0},
    },
    "dapo": {
        "adv_estimator": "grpo",
        "norm_adv_by_std": "group",
        "policy_loss": "ppo",
        "loss_agg_mode": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dynamic_sampling": True,
        "overlong": {"mode": "penalty", "penalty_factor": 1.0},
        "kl": {"coef": 0.0},
    },
    "gspo": {
        "adv_estimator": "grpo",
        "norm_adv_by_std": "group",
        "policy_loss": "gspo",
        "loss_agg_mode": "seq-mean-token-mean",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "kl": {"coef": 0.0},
    },
    "reinforce_plus_plus": {
        "adv_estimator": "reinforce_plus_plus",
        "gamma": 1.0,
        "policy_loss": "ppo",
        "loss_agg_mode": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl": {"coef": 0.001, "estimator": "k1", "use_as": "reward"},
    },
    "rloo": {
        "adv_estimator": "rloo",
        "policy_loss": "ppo",
        "loss_agg_mode": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl": {"coef": 0.0},
    },
    "topr": {
        "adv_estimator": "dr_grpo",
        "policy_loss": "topr",
        "loss_agg_mode": "seq-mean-token-sum",
        "kl": {"coef": 0.0},
    },
    "cispo": {
        "adv_estimator": "grpo",
        "norm_adv_by_std": "group",
        "policy_loss": "cispo",
        "loss_agg_mode": "token-mean",
        "clip_low": 1.0,
        "clip_high": 0.28,
        "kl": {"coef": 0.0},
    },
    "lite_ppo": {
        "adv_estimator": "grpo",
        "norm_adv_by_std": "batch",
        "policy_loss": "ppo",
        "loss_agg_mode": "token-mean",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "kl": {"coef": 0.0},
    },
    "raft_plus_plus": {
        "adv_estimator": "reinforce",
        "gamma": 1.0,
        "policy_loss": "ppo",
        "loss_agg_mode": "seq-mean-token-sum",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "dual_clip_c": 3.0,
        "reward": {"normalize": "none", "clip": 10.0},
        "advantage": {"whiten": False, "clip": 2.0},
        "kl": {"coef": 0.001, "use_as": "loss"},
    },
}
"""Preset name -> the algorithm keys it sets (recipe keys override them)."""

_NAMED_KEYS: dict[str, tuple[str, ...]] = {
    "adv_estimator": get_args(AdvEstimatorName),
    "policy_loss": get_args(PolicyLossName),
    "loss_agg_mode": get_args(LossAggMode),
}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` on top of `base`, recursing into sub-sections that are mappings in both."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _did_you_mean(value: object, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), list(valid), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


class AlgorithmConfig(Strict):
    """The RL algorithm: advantage estimator, policy loss, KL, normalisation and shaping.

    `preset` fills every key it lists (see docs/algorithms.md) and recipe keys override it.
    """

    preset: PresetName | None = Field(
        default=None,
        description="Named recipe of the keys below (ppo, grpo, dr_grpo, dapo, gspo, "
        "reinforce_plus_plus, rloo, topr, cispo, lite_ppo, raft_plus_plus; values in "
        "docs/algorithms.md). "
        "Keys set in the recipe override the preset.",
    )
    adv_estimator: AdvEstimatorName = Field(
        default="grpo",
        description="Advantage estimator. `gae` needs a critic; `grpo`, `dr_grpo`, `rloo` and "
        "`reinforce_plus_plus_baseline` need 2 or more samples per prompt.",
    )
    norm_adv_by_std: Literal["group", "batch", "none"] | None = Field(
        default=None,
        description="`grpo` only: divide the centred score by the std of its `group` (GRPO), "
        "of the whole `batch` (LitePPO) or by nothing (`none`, as dr_grpo). Null: `group`.",
    )
    adv_eps: float = Field(
        default=1e-6, gt=0, description="Added to a standard deviation before dividing by it."
    )
    gamma: float = Field(
        default=1.0, ge=0, le=1, description="Discount of `gae`, `reinforce` and REINFORCE++."
    )
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda (`gae` only).")
    policy_loss: PolicyLossName = Field(
        default="ppo",
        description="`ppo` (clipped, with clip-higher and dual clip), `gspo` (sequence ratio), "
        "`cispo` (clipped IS weight), `topr` (tapered off-policy REINFORCE), `pg` (vanilla "
        "policy gradient), `decoupled_ppo` (AReaL: PPO clip around the trainer's old policy, "
        "times the capped weight pi_old / pi_behaviour for off-policy async samples).",
    )
    loss_agg_mode: LossAggMode = Field(
        default="token-mean",
        description="How token losses become one number: `token-mean` (every token weighs the "
        "same), `seq-mean-token-mean` (every response weighs the same), `seq-mean-token-sum`, "
        "`seq-mean-token-sum-norm` (token sum / a constant length, Dr.GRPO).",
    )
    loss_agg_norm_len: int | None = Field(
        default=None,
        ge=1,
        description="The constant length of `seq-mean-token-sum-norm` (null: the generation "
        "length limit).",
    )
    clip_low: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Lower clip range: the ratio is clipped below at 1 - clip_low (`ppo`, "
        "`gspo`, `cispo`; 1 means no lower bound).",
    )
    clip_high: float = Field(
        default=0.2,
        ge=0,
        description="Upper clip range: the ratio is clipped above at 1 + clip_high "
        "(clip-higher: a larger value than clip_low, e.g. DAPO's 0.28).",
    )
    dual_clip_c: float | None = Field(
        default=None,
        gt=1,
        description="`ppo` only: dual-clip bound for negative advantages (e.g. 3.0; null: off).",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="Alias of `rollout_correction: {is_level: token, is_cap: <tis_cap>}` "
        "(token-level truncated importance sampling, min(pi_old / pi_infer, tis_cap); e.g. 2.0; "
        "null: off): validation moves it there and sets it back to null, so the resolved "
        "config.yaml shows the rollout_correction section. Not with `policy_loss: "
        "decoupled_ppo` (its behaviour weight is that correction already) or with "
        "`rollout_correction.is_level`.",
    )
    rollout_correction: RolloutCorrectionConfig | None = Field(
        default=None,
        description="Train-inference mismatch correction: importance weights and rejection "
        "(null: off; an empty section logs the mismatch metrics only). Unset with "
        "rollout.async_generation_ratio > 0 (and policy_loss not decoupled_ppo): "
        "`{preset: token_tis}`, so stale samples are weighted by min(pi_old / pi_behaviour, 2); "
        "write `rollout_correction: null` to train them uncorrected.",
    )
    on_policy_distill: OnPolicyDistillConfig | None = Field(
        default=None,
        description="On-policy distillation (`roll train rlvr`): a teacher's per-token reverse "
        "KL on the student's samples is the advantage (null: off; docs/distill.md).",
    )
    entropy_coef: float = Field(
        default=0.0, ge=0, description="Entropy bonus coefficient (0: off)."
    )
    kl: KLConfig = Field(default_factory=KLConfig, description="KL to the reference model.")
    reward: ScoreConfig = Field(
        default_factory=ScoreConfig, description="Score normalisation and clipping."
    )
    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="Advantage whitening and clipping."
    )
    value: ValueConfig = Field(default_factory=ValueConfig, description="Critic loss (gae).")
    dynamic_sampling: bool = Field(
        default=False,
        description="Drop prompt groups whose samples all got the same score and sample more "
        "prompts until the batch is full (DAPO).",
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig, description="Responses cut off at the length limit."
    )
    router_replay: Literal["off", "r3"] = Field(
        default="off",
        description="Mixture-of-experts routing replay. `r3`: the inference engine records "
        "the experts every token was routed to, and every trainer forward of the step (old "
        "and reference log-probs, the update) routes each token through those experts; the "
        "gate weights still come from the trainer's router logits, so the router keeps "
        "learning. Logs `router/agreement` (per layer too): how often the trainer's own "
        "top-k agreed. Needs an MoE model and actor_infer.backend hf; every "
        "actor_train.backend (megatron without model.gradient_checkpointing; "
        'docs/algorithms.md "Router replay"). `off`: each side routes itself.',
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, valid in _NAMED_KEYS.items():
            value = data.get(key)
            if isinstance(value, str) and value not in valid:
                raise ValueError(
                    f"{key}: unknown value {value!r}; {_did_you_mean(value, valid)}"
                    f"valid: {', '.join(valid)}"
                )
        name = data.get("preset")
        if name is None:
            return data
        if name not in PRESETS:
            raise ValueError(
                f"unknown preset {name!r}; {_did_you_mean(name, tuple(PRESETS))}"
                f"valid presets: {', '.join(PRESETS)}"
            )
        return _merge(PRESETS[name], data)

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.norm_adv_by_std is not None and self.adv_estimator not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"norm_adv_by_std only applies to adv_estimator grpo, not "
                f"{self.adv_estimator}; remove it"
            )
        if self.adv_estimator == "dr_grpo" and self.norm_adv_by_std not in (None, "none"):
            raise ValueError(
                "dr_grpo is grpo without the std division; for "
                f"norm_adv_by_std: {self.norm_adv_by_std} use adv_estimator: grpo"
            )
        if self.tis_cap is not None and self.policy_loss == "decoupled_ppo":
            raise ValueError(
                "tis_cap with policy_loss decoupled_ppo would correct for the inference engine "
                "twice: decoupled_ppo already weights every token by pi_old / pi_behaviour "
                "(capped), computed from the same log-probs. Remove tis_cap, or use "
                "policy_loss ppo with tis_cap"
            )
        rc = self.rollout_correction
        if rc is not None and rc.is_level is not None and self.tis_cap is not None:
            raise ValueError(
                "tis_cap with rollout_correction.is_level would weight every token by "
                "pi_old / pi_infer twice (tis_cap is token-level TIS): remove tis_cap, or "
                "use rollout_correction.preset token_tis alone"
            )
        if self.tis_cap is not None:
            self._fold_tis_cap()
            rc = self.rollout_correction
        if rc is not None and rc.is_level is not None and self.policy_loss == "decoupled_ppo":
            raise ValueError(
                "rollout_correction.is_level with policy_loss decoupled_ppo would correct "
                "for the sampler twice: decoupled_ppo already weights every token by "
                "pi_old / pi_behaviour. Remove is_level (rejection, rs_*, may stay), or "
                "use policy_loss ppo"
            )
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"dual_clip_c only applies to policy_loss ppo, not {self.policy_loss}; remove it"
            )
        return self

    def _fold_tis_cap(self) -> None:
        """`tis_cap` is an alias: move it into `rollout_correction` (one code path, one set of
        metrics) and clear it, so the resolved config validates to the same thing again."""
        cap, rc = self.tis_cap, self.rollout_correction
        keys = rc.model_dump(exclude_unset=True, exclude={"preset"}) if rc is not None else {}
        self.rollout_correction = RolloutCorrectionConfig(
            **{**keys, "is_level": "token", "is_cap": cap}
        )
        self.tis_cap = None

    @property
    def uses_reference(self) -> bool:
        """True when a reference model is needed (any KL term)."""
        return self.kl.coef > 0

    @property
    def uses_critic(self) -> bool:
        """True when a critic is needed (`gae`)."""
        return self.adv_estimator == "gae"

    @property
    def needs_groups(self) -> bool:
        """True when every prompt needs 2 or more samples (a group estimator or group norm)."""
        opd = self.on_policy_distill
        if opd is not None and opd.reward_weight == 0:  # pure distillation: no task advantage
            return False
        return self.adv_estimator in GROUP_ESTIMATORS or self.reward.normalize == "group"

    def advantage_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`roll_core.algorithms.compute_advantages` (besides the
        tensors); each estimator takes the ones it uses."""
        return {
            "gamma": self.gamma,
            "lam": self.lam,
            "eps": self.adv_eps,
            "norm_adv_by_std": self.norm_adv_by_std,
        }

    def policy_loss_kwargs(self, *, max_len: int | None = None) -> dict[str, Any]:
        """Keyword arguments for :func:`roll_core.algorithms.policy_loss` (besides the name and
        the tensors). `max_len` is the generation length limit, the default constant of
        ``seq-mean-token-sum-norm``."""
        return {
            "agg_mode": self.loss_agg_mode,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "clip_c": self.dual_clip_c,
            "max_len": self.loss_agg_norm_len or max_len,
        }
