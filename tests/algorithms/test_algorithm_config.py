"""The `algorithm:` recipe section: presets, overrides, names kept equal to the registries."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import yaml

from roll_core.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    REWARD_NORMALIZERS,
    compute_advantages,
    policy_loss,
    scores_to_token_rewards,
)
from roll_core.config.algorithm import (
    PRESETS,
    AdvEstimatorName,
    AlgorithmConfig,
    KLEstimatorName,
    LossAggMode,
    PolicyLossName,
    PresetName,
    ScoreConfig,
)
from roll_core.config.loader import dump_config, validate
from roll_core.errors import ConfigError


def load(data: dict[str, Any]) -> AlgorithmConfig:
    return validate(AlgorithmConfig, data, source="recipe.yaml")


def test_schema_names_equal_the_registries() -> None:
    assert list(get_args(AdvEstimatorName)) == ADV_ESTIMATORS.names()
    assert list(get_args(PolicyLossName)) == POLICY_LOSSES.names()
    assert get_args(LossAggMode) == LOSS_AGG_MODES
    assert list(get_args(KLEstimatorName)) == list(KL_ESTIMATORS)
    assert get_args(ScoreConfig.model_fields["normalize"].annotation) == REWARD_NORMALIZERS
    assert list(get_args(PresetName)) == list(PRESETS)


def test_defaults() -> None:
    cfg = load({})
    assert (cfg.adv_estimator, cfg.policy_loss, cfg.loss_agg_mode) == ("grpo", "ppo", "token-mean")
    assert not cfg.uses_reference and not cfg.uses_critic and cfg.needs_groups


def test_dapo_preset() -> None:
    cfg = load({"preset": "dapo"})
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    assert cfg.dynamic_sampling and cfg.loss_agg_mode == "token-mean"
    assert cfg.overlong.mode == "penalty" and cfg.kl.coef == 0.0


def test_recipe_keys_override_the_preset_section_by_section() -> None:
    cfg = load({"preset": "grpo", "clip_high": 0.3, "kl": {"coef": 0.1}})
    assert cfg.clip_high == 0.3 and cfg.clip_low == 0.2  # clip_low from the preset
    # kl.coef from the recipe, kl.estimator and kl.use_as still from the preset
    assert (cfg.kl.coef, cfg.kl.estimator, cfg.kl.use_as) == (0.1, "low_var_k3", "loss")
    assert cfg.uses_reference


def test_ppo_preset_needs_a_critic_and_a_reference() -> None:
    cfg = load({"preset": "ppo"})
    assert cfg.uses_critic and cfg.uses_reference and cfg.advantage.whiten
    assert not cfg.needs_groups


def test_resolved_config_reloads_identically() -> None:
    for name in PRESETS:
        # clip_high 0.2 is the class default but not dapo's: it must survive the round trip
        cfg = load({"preset": name, "entropy_coef": 0.001, "clip_high": 0.2})
        again = load(yaml.safe_load(dump_config(cfg)))
        assert again == cfg and again.clip_high == 0.2, name


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load({"preset": "dapoo"})
    msg = str(info.value)
    assert "recipe.yaml: unknown preset 'dapoo'; did you mean 'dapo'?" in msg
    assert "valid presets: ppo, grpo, dr_grpo, dapo, gspo" in msg


@pytest.mark.parametrize(
    ("key", "value", "suggestion"),
    [
        ("adv_estimator", "grop", "grpo"),
        ("policy_loss", "cispo_", "cispo"),
        ("loss_agg_mode", "token_mean", "token-mean"),
    ],
)
def test_unknown_names_suggest_the_closest(key: str, value: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({key: value})
    assert f"{key}: unknown value {value!r}; did you mean {suggestion!r}?" in str(info.value)


def test_unknown_kl_estimator_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load({"kl": {"estimator": "k4"}})
    assert "kl.estimator" in str(info.value) and "'low_var_k3'" in str(info.value)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"adv_estimator": "rloo", "norm_adv_by_std": "batch"}, "only applies to adv_estimator"),
        ({"adv_estimator": "dr_grpo", "norm_adv_by_std": "group"}, "use adv_estimator: grpo"),
        ({"policy_loss": "gspo", "dual_clip_c": 3.0}, "dual_clip_c only applies"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        (
            {"kl": {"coef": 0.1, "target": 0.05}},
            "kl: target (the adaptive KL coefficient) only works with use_as: reward",
        ),
        ({"kl": {"use_as": "reward", "target": 0.05}}, "kl: target is set but coef is 0"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"typo_key": 1}, "typo_key: unknown key"),
    ],
)
def test_inconsistent_settings_are_errors(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(data)
    assert fragment in str(info.value)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_through_the_library(preset: str) -> None:
    """The kwargs the config hands out are accepted by the functions it names."""
    cfg = load({"preset": preset, "tis_cap": 2.0})
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask)
    adv, _ = compute_advantages(
        cfg.adv_estimator,
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1, 1]),
        values=torch.rand(4, 3),
        **cfg.advantage_kwargs(),
    )
    logp = (torch.rand(4, 3) - 2).requires_grad_(True)
    loss, metrics = policy_loss(
        cfg.policy_loss,
        log_probs=logp,
        old_log_probs=logp.detach() + 0.01,
        infer_log_probs=logp.detach(),
        advantages=adv,
        response_mask=mask,
        **cfg.policy_loss_kwargs(max_len=3),
    )
    loss.backward()
    assert torch.isfinite(loss) and logp.grad is not None
    assert "actor/pg_loss" in metrics
    # tis_cap is folded into the rollout correction, never applied by the policy loss
    assert cfg.tis_cap is None and "tis_cap" not in cfg.policy_loss_kwargs()
    assert cfg.rollout_correction is not None
    assert (cfg.rollout_correction.is_level, cfg.rollout_correction.is_cap) == ("token", 2.0)


def _flat(section: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            shown = str(value).lower() if isinstance(value, bool) else value
            out.append(f"`{prefix}{key}: {shown}`")
    return out


def test_docs_preset_table_matches_the_presets() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    for name, section in PRESETS.items():
        row = f"| `{name}` | " + ", ".join(_flat(section)) + " |"
        assert row in doc, f"docs/algorithms.md preset table is stale for {name}: {row}"


def test_raft_plus_plus_preset() -> None:
    cfg = AlgorithmConfig(preset="raft_plus_plus")
    # RAFT++ (arXiv 2504.11343): REINFORCE return as the advantage, PPO ratio and clip
    assert cfg.adv_estimator == "reinforce" and cfg.policy_loss == "ppo"
    assert cfg.reward.normalize == "none" and not cfg.advantage.whiten
    assert not cfg.needs_groups and not cfg.uses_critic
