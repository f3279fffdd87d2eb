"""Reward names, dotted paths to user functions, and the `reward` recipe section."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config.loader import validate
from roll_core.config.reward import (
    BUILTIN_REWARDS,
    DomainRewardConfig,
    RewardConfig,
    RewardFnConfig,
)
from roll_core.errors import ConfigError
from roll_core.rewards import (
    REWARDS,
    FormatReward,
    MathReward,
    RewardResult,
    RewardSample,
    build_domain_reward,
    build_reward,
    load_user_function,
)
from roll_core.rewards.registry import builtin_options


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_reward("maths")
    text = str(err.value)
    assert "unknown reward 'maths'" in text
    assert "Did you mean 'math'?" in text
    assert "math, format" in text
    assert "pkg.module:function" in text


def test_builtins_take_their_own_options() -> None:
    assert build_reward("math", answer_pattern=r"(\d+)") == MathReward(answer_pattern=r"(\d+)")
    assert build_reward("format", pattern="x") == FormatReward(pattern="x")
    with pytest.raises(ConfigError, match="takes no option 'pattern'; its options: answer_key"):
        build_reward("math", pattern="x")
    with pytest.raises(ConfigError, match="takes no option 'args'"):
        build_reward("format", args={"a": 1})


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon.module", "unknown reward"),
        ("pkg.mod:", "not a dotted path"),
        ("pkg mod:fn", "not a dotted path"),
        ("surely_missing_pkg_xyz.mod:fn", "cannot import module 'surely_missing_pkg_xyz.mod'"),
        ("reward_fns_for_tests:nope", "has no attribute 'nope'. Its public callables: boom"),
        ("reward_fns_for_tests:NOT_A_FUNCTION", "of type int, not a function"),
    ],
)
def test_bad_dotted_paths(user_fns, path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_reward(path)


def test_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('bad module')\n")
    (tmp_path / "needs_missing_dep.py").write_text("import surely_missing_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="raised RuntimeError: bad module"):
        load_user_function("broken_reward_mod:fn")
    with pytest.raises(ConfigError, match="importing 'needs_missing_dep' failed"):
        load_user_function("needs_missing_dep:fn")


def test_user_function_signature_is_checked(user_fns) -> None:
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(sample, colour=...\)"):
        build_reward("reward_fns_for_tests:length_score", args={"colour": "red"})
    with pytest.raises(ConfigError, match="apply to built-in rewards only"):
        build_reward("reward_fns_for_tests:length_score", answer_key="x")


def test_user_function_with_args(user_fns) -> None:
    fn = build_reward("reward_fns_for_tests:keyword", args={"word": "ok", "bonus": 2.0})
    assert fn(RewardSample("q", "it is ok")) == RewardResult(2.0, {"correct": True})
    plain = build_reward("reward_fns_for_tests:length_score")
    assert plain(RewardSample("q", "12345")) == RewardResult(0.5)  # 5 chars / 10


def test_bad_return_values_raise(user_fns) -> None:
    with pytest.raises(TypeError, match="returned 'high' \\(str\\); return a float"):
        build_reward("reward_fns_for_tests:returns_text")(RewardSample("q", "r"))
    with pytest.raises(ValueError, match="non-finite score nan"):
        build_reward("reward_fns_for_tests:returns_nan")(RewardSample("q", "r"))


def test_domain_reward_labels_and_weights(user_fns) -> None:
    spec = DomainRewardConfig.model_validate(
        {"rewards": ["math", {"name": "reward_fns_for_tests:length_score", "weight": 2.0}]}
    )
    fn = build_domain_reward(spec)
    r = fn(RewardSample("q", "68", {"answer": "68"}))
    # 1.0 * 1 (right answer) + 2.0 * len("68") / 10 = 1.4
    assert r.score == pytest.approx(1.4)
    assert r.info["math/score"] == 1.0 and r.info["length_score/score"] == pytest.approx(0.2)


def test_config_defaults_score_math_rows() -> None:
    cfg = RewardConfig()
    assert list(cfg.domains) == ["math"]
    assert cfg.domains["math"].rewards == [RewardFnConfig(name="math")]
    assert cfg.domains["math"].timeout_s == 5.0
    assert cfg.isolation == "process"


def test_config_shorthand() -> None:
    cfg = RewardConfig.model_validate(
        {"domains": {"math": "math", "mix": ["math", {"name": "format", "weight": 0.1}]}}
    )
    assert cfg.domains["math"].rewards == [RewardFnConfig(name="math")]
    assert [r.name for r in cfg.domains["mix"].rewards] == ["math", "format"]
    assert cfg.domains["mix"].rewards[1].weight == 0.1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"domains": {"math": "maht"}}, "unknown reward 'maht'; did you mean 'math'?"),
        ({"domains": {"m": {"rewards": [{"name": "format", "answer_key": "x"}]}}}, "answer_key"),
        ({"domains": {"m": {"rewards": [{"name": "math", "pattern": "("}]}}}, "regular expr"),
        ({"domains": {"m": {"timeout_s": 0}}}, "greater than 0"),
        ({"domains": {"m": {"rewards": []}}}, "at least 1 item"),
        ({"domains": {}}, "at least 1 item"),
        ({"default_domain": "code"}, "default_domain 'code' is not one of"),
        ({"isolation": "fork"}, "'process' or 'thread'"),
        ({"domains": {"math": {"reward": "math"}}}, "unknown key"),
    ],
)
def test_config_errors_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        validate(RewardConfig, data, source="recipe.yaml")
    assert str(err.value).startswith("recipe.yaml: ")


def test_every_field_has_a_description() -> None:
    for model in (RewardConfig, DomainRewardConfig, RewardFnConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_config_knows_every_registered_reward() -> None:
    # the config layer keeps its own table (it does not import roll_core.rewards)
    assert {n: set(o) for n, o in BUILTIN_REWARDS.items()} == {
        n: builtin_options(n) for n in REWARDS
    }


def test_docs_cover_every_reward_key() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    for model in (RewardConfig, DomainRewardConfig, RewardFnConfig):
        for name in model.model_fields:
            assert f"`{name}`" in docs or f".{name}`" in docs, f"docs/rewards.md lacks {name}"
    for name in REWARDS:
        assert f"### `{name}`" in docs
