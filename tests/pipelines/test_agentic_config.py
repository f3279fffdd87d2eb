"""The agentic recipe schema and the pipeline's recipe checks (no model is loaded)."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core.config import validate
from roll_core.config.agentic import AgenticConfig
from roll_core.engine.plan import make_plan
from roll_core.errors import ConfigError
from roll_core.pipelines import agentic


def cfg(**sections: Any) -> AgenticConfig:
    data: dict[str, Any] = {
        "pipeline": "agentic",
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [{"env": "frozen_lake", "groups_per_step": 3}],
        "rollout": {"group_size": 4},
        "trainer": {"max_steps": 2},
    }
    data.update(sections)
    return validate(AgenticConfig, data, source="test")  # type: ignore[return-value]


def test_dynamic_sampling_keys_validate() -> None:
    c = cfg(algorithm={"dynamic_sampling": True}, rollout={"max_additional_groups": 3})
    assert c.algorithm.dynamic_sampling and c.rollout.max_additional_groups == 3


def test_defaults_and_plan() -> None:
    c = cfg(rollout={"group_size": 4, "redundant_groups": 2})
    assert c.envs[0].name == "frozen_lake"
    assert c.rollout.mode == "trajectory" and c.rollout.async_generation_ratio == 0
    roles = {r.role: r for r in agentic.plan(c, make_plan(c))}
    assert roles["envs"].world_size == (3 + 2) * 4  # threads for every launched episode
    assert "12 episodes/step" in roles["actor_train"].detail


def test_the_removed_episode_redundancy_key_says_what_replaced_it() -> None:
    with pytest.raises(ConfigError) as info:
        cfg(rollout={"group_size": 4, "group_size_redundancy": 2})
    text = " ".join(str(info.value).split())
    assert "rollout.group_size_redundancy: removed" in text
    assert "favours short episodes" in text and "rollout.redundant_groups" in text


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"trainer": {"max_steps": 2, "mini_batches": 5}}, "must divide the episodes"),
        (
            {"envs": [{"env": "sokoban"}, {"env": "sokoban"}]},
            "tags must be distinct",
        ),
        (
            {"rollout": {"turn_barrier": True, "async_generation_ratio": 1}},
            "turn_barrier",
        ),
        ({"rollout": {"mode": "stepwise"}}, "mode"),
        ({"rollout": {"group_size": 4, "max_additional_groups": -1}}, "max_additional_groups"),
    ],
)
def test_schema_errors(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg(**sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"rollout": {"group_size": 1}}, "compares the episodes of a group"),
        ({"rollout": {"group_size": 1, "mode": "step"}}, "group_size"),
        (
            {"rollout": {"mode": "step"}, "algorithm": {"kl": {"coef": 0.1, "use_as": "reward"}}},
            "KL penalty",
        ),
    ],
)
def test_algorithm_checks(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        agentic.check_algorithm(cfg(**sections))


def test_two_envs_of_one_kind_with_tags() -> None:
    c = cfg(envs=[{"env": "sokoban", "tag": "small"}, {"env": "sokoban", "tag": "big"}])
    assert [s.tag for s in agentic.env_specs(c)] == ["small", "big"]
    env = agentic.env_specs(c)[0].factory()
    assert env.name == "sokoban"


def test_eval_options_apply_to_validation_episodes_only() -> None:
    """`eval_options` (e.g. held-out tasks) are merged over `options` in the validation
    specs; training specs keep `options`; a bad one fails the run's checks."""
    entry = {"env": "frozen_lake", "options": {"size": 4}, "eval_options": {"size": 5}}
    c = cfg(envs=[entry])
    assert agentic.env_specs(c)[0].factory().options.size == 4
    assert agentic.env_specs(c, validation=True)[0].factory().options.size == 5
    bad = cfg(envs=[{**entry, "eval_options": {"sizee": 5}}])
    with pytest.raises(ConfigError, match="sizee"):
        agentic.check_env(bad.envs[0], 10.0)
    unused = cfg(envs=[{**entry, "eval_options": {"sizee": 5}, "eval_episodes": 0}])
    agentic.check_env(unused.envs[0], 10.0)  # no validation episodes: not made, not checked
