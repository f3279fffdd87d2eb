"""`algorithm.rollout_correction`: presets, validation (recipe errors), names = the library's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import yaml

from roll_core.algorithms import rollout_correction
from roll_core.algorithms.rollout_correction import DIVERGENCE_OPTIONS, LEVELS
from roll_core.config.algorithm import (
    CORRECTION_PRESETS,
    AlgorithmConfig,
    CorrectionLevel,
    CorrectionPresetName,
    DivergenceOption,
)
from roll_core.config.loader import dump_config, validate
from roll_core.errors import ConfigError


def load(data: dict[str, Any]) -> AlgorithmConfig:
    return validate(AlgorithmConfig, data, source="recipe.yaml")


def test_schema_names_equal_the_library() -> None:
    assert get_args(CorrectionLevel) == LEVELS
    assert get_args(DivergenceOption) == DIVERGENCE_OPTIONS
    assert list(get_args(CorrectionPresetName)) == list(CORRECTION_PRESETS)


def test_off_by_default_and_an_empty_section_only_measures() -> None:
    assert load({}).rollout_correction is None
    rc = load({"rollout_correction": {}}).rollout_correction
    assert rc is not None and rc.is_level is None and rc.rs_level is None
    assert rc.kwargs()["rs_divergence"] == []


GEO = [("seq_mean_k1", 0.999, 1.001)]  # verl: rollout_rs seq_mean_k1, threshold "0.999_1.001"
K3 = [("seq_mean_k3", None, 0.01)]  # verl: rollout_rs seq_mean_k3, threshold 0.01


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        # verl's RolloutCorrectionConfig.decoupled_* class methods, with their default arguments
        ("token_tis", {"is_level": "token", "is_cap": 2.0, "rs_divergence": []}),
        ("seq_tis", {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": []}),
        ("token_icepop", {"is_level": "token", "is_cap": 5.0, "is_low": 0.5}),
        (
            "seq_tis_rs",
            {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": [("seq_sum_k1", 0.5, 2.0)]},
        ),
        ("geo_rs", {"is_level": None, "rs_level": None, "rs_divergence": GEO}),
        ("geo_rs_seq_tis", {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": GEO}),
        ("geo_rs_token_tis", {"is_level": "token", "is_cap": 2.0, "rs_divergence": GEO}),
        ("k3_rs", {"is_level": None, "rs_divergence": K3}),
        ("k3_rs_seq_tis", {"is_level": "sequence", "is_cap": 2.0, "rs_divergence": K3}),
        ("k3_rs_token_tis", {"is_level": "token", "is_cap": 2.0, "rs_divergence": K3}),
        # Yao et al.'s MIS
        ("token_mis", {"is_level": "token", "is_cap": None, "rs_low": 0.0, "rs_high": 2.0}),
    ],
)
def test_presets(preset: str, expected: dict[str, Any]) -> None:
    kwargs = load({"rollout_correction": {"preset": preset}}).rollout_correction.kwargs()
    for key, value in expected.items():
        assert kwargs[key] == value, key
    # and the library accepts what the config hands out
    logp = torch.tensor([[-1.0, -2.0]])
    _, _, metrics = rollout_correction(
        old_log_probs=logp, rollout_log_probs=logp - 0.1, response_mask=torch.ones(1, 2), **kwargs
    )
    assert "rollout_corr/kl" in metrics


def test_recipe_keys_override_the_preset() -> None:
    rc = load({"rollout_correction": {"preset": "token_tis", "is_cap": 5.0}}).rollout_correction
    assert (rc.is_level, rc.is_cap) == ("token", 5.0)


def test_resolved_config_reloads_identically() -> None:
    for data in ({}, {"preset": "geo_rs"}, {"preset": "token_mis"}):
        cfg = load({"rollout_correction": data, "policy_loss": "ppo"})
        again = load(yaml.safe_load(dump_config(cfg)))
        assert again == cfg


def test_divergence_bands() -> None:
    rc = load(
        {
            "rollout_correction": {
                "rs_divergence": [
                    {"option": "seq_mean_k3", "high": 0.01},
                    {"option": "token_k1", "low": 0.5, "high": 2.0},
                ]
            }
        }
    ).rollout_correction
    assert rc.kwargs()["rs_divergence"] == [("seq_mean_k3", None, 0.01), ("token_k1", 0.5, 2.0)]


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"is_level": "tokn"}, "is_level: unknown level 'tokn'; did you mean 'token'?"),
        ({"rs_level": "geometrc"}, "rs_level: unknown level 'geometrc'; did you mean 'geometric'?"),
        (
            {"rs_divergence": [{"option": "seq_mean_k", "high": 1.0}]},
            "rs_divergence[0].option: unknown option 'seq_mean_k'; did you mean",
        ),
        ({"preset": "token_ti"}, "unknown preset 'token_ti'; did you mean 'token_tis'?"),
        ({"rs_level": "token", "rs_low": 2.0, "rs_high": 2.0}, "rs_low 2.0 >= rs_high 2.0"),
        ({"rs_level": "token", "rs_high": 0.5}, "rs_low 2.0 >= rs_high 0.5"),
        ({"rs_level": "token"}, "rs_level token needs rs_high"),
        ({"rs_high": 2.0}, "rs_high/rs_low are set but rs_level is not"),
        ({"is_cap": 3.0}, "is_cap/is_low are set but is_level is not"),
        ({"is_level": "token", "is_low": 0.5, "is_cap": None}, "is_low (IcePop) needs"),
        ({"is_level": "token", "is_low": 3.0, "is_cap": 2.0}, "is_low 3.0 >= is_cap 2.0"),
        ({"is_level": "token", "is_low": -0.5, "is_cap": 2.0}, "is_low"),
        (
            {"rs_divergence": [{"option": "token_k1", "low": 2.0, "high": 1.0}]},
            "the band low 2.0 >= high 1.0",
        ),
        (
            {"rs_divergence": [{"option": "seq_sum_k3", "low": 0.1, "high": 1.0}]},
            "low only applies to k1 options",
        ),
        ({"rs_level": "token", "rs_high": -1.0}, "rs_high"),
        ({"is_level": "token", "is_cap": -1.0}, "is_cap"),
        ({"is_level": "token", "is_cap": 0.0}, "is_cap"),
    ],
)
def test_bad_sections_are_recipe_errors(section: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({"rollout_correction": section})
    assert fragment in str(info.value)
    assert "rollout_correction" in str(info.value)  # the key path is named


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (
            {"tis_cap": 2.0, "rollout_correction": {"preset": "token_tis"}},
            "would weight every token by pi_old / pi_infer twice",
        ),
        (
            {"policy_loss": "decoupled_ppo", "rollout_correction": {"is_level": "sequence"}},
            "would correct for the sampler twice",
        ),
    ],
)
def test_double_corrections_are_errors(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(data)
    assert fragment in str(info.value)


def test_rejection_combines_with_tis_cap_and_decoupled_ppo() -> None:
    # masks are not weights: no double correction
    cfg = load({"tis_cap": 3.0, "rollout_correction": {"preset": "geo_rs"}})
    rc = cfg.rollout_correction
    assert rc is not None and cfg.tis_cap is None
    assert (rc.is_level, rc.is_cap, rc.kwargs()["rs_divergence"]) == ("token", 3.0, GEO)
    load({"policy_loss": "decoupled_ppo", "rollout_correction": {"preset": "geo_rs"}})


def test_tis_cap_is_an_alias_of_token_tis() -> None:
    """One key, one code path: `tis_cap: C` validates to the same config as the token_tis
    preset with `is_cap: C`, and the resolved config (tis_cap null) reloads identically."""
    alias = load({"tis_cap": 1.5})
    explicit = load({"rollout_correction": {"preset": "token_tis", "is_cap": 1.5}})
    assert alias.tis_cap is None
    assert alias.rollout_correction is not None and explicit.rollout_correction is not None
    assert alias.rollout_correction.kwargs() == explicit.rollout_correction.kwargs()
    assert load(yaml.safe_load(dump_config(alias))) == alias
    with pytest.raises(ConfigError, match="tis_cap"):
        load({"tis_cap": -1.0})


def test_docs_list_every_correction_preset() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    for name, keys in CORRECTION_PRESETS.items():
        shown = ", ".join(f"`{k}: {_flow(v)}`" for k, v in keys.items())
        row = f"| `{name}` | {shown} |"
        assert row in doc, f"docs/algorithms.md rollout-correction presets are stale: {row}"


def _flow(value: Any) -> str:
    """A preset value as the docs table shows it (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return str(value)
