"""The agentic warm start's scripted policies: random valid actions, or the env's expert."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config.agentic import AgenticConfig
from roll_core.envs import make_env
from roll_core.errors import ConfigError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.pipelines.agentic import AgenticSetup, env_specs
from roll_core.pipelines.checks.agentic import check_warm_start
from roll_core.pipelines.warm_start import demonstrations

SOKOBAN = {"width": 6, "height": 6, "max_steps": 6}


def config(env: str, options: dict, policy: str) -> AgenticConfig:
    return AgenticConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "envs": [{"env": env, "options": options, "system_prompt": "", "groups_per_step": 1}],
            "warm_start": {"steps": 1, "policy": policy},
            "trainer": {"max_steps": 1},
        }
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> AgenticSetup:
    path = str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))
    return AgenticSetup(path, path, load_tokenizer(path), 512)


def test_expert_demonstrations_play_the_solver(setup: AgenticSetup) -> None:
    cfg = config("sokoban", SOKOBAN, "expert")
    demos = demonstrations(cfg, setup, env_specs(cfg), count=6, offset=3)
    assert len(demos) == 6
    for traj in demos:
        env = make_env("sokoban", **SOKOBAN)
        env.reset(traj.seed)
        expected = []
        while not env.done:
            expected.append(env.expert_action())
            env.step(expected[-1])
        assert [t.action for t in traj.turns] == expected
        assert traj.success and all(t.action_is_valid for t in traj.turns)
        # the response is the action's text and the end of the turn, nothing else
        text = setup.tokenizer.decode(traj.turns[0].response_ids, skip_special_tokens=True)
        assert text == expected[0]


def test_random_demonstrations_are_not_the_solver(setup: AgenticSetup) -> None:
    cfg = config("sokoban", SOKOBAN, "random")
    demos = demonstrations(cfg, setup, env_specs(cfg), count=16, offset=0)
    # random play solves about a third of these rooms within 6 moves; the expert all of them
    assert sum(t.success for t in demos) < 16
    assert all(t.action_is_valid for d in demos for t in d.turns)


def test_expert_policy_needs_an_env_with_a_solver() -> None:
    check_warm_start(config("frozen_lake", {}, "expert"))  # has one: no error
    check_warm_start(config("tool_use", {}, "random"))
    with pytest.raises(ConfigError, match=r"envs\[0\] \(tool_use.*has none") as err:
        check_warm_start(config("tool_use", {}, "expert"))
    assert "warm_start.policy: random" in err.value.hint


def test_expert_warm_start_validates_in_the_cli(roll, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "pipeline: agentic\nmodel: {path: builtin:tiny-qwen3}\n"
        "envs: [{env: tool_use, groups_per_step: 1}]\n"
        "warm_start: {steps: 2, policy: expert}\ntrainer: {max_steps: 1}\n"
    )
    res = roll("validate", str(recipe))
    assert res.returncode != 0
    assert "has none" in res.stderr + res.stdout and "Traceback" not in res.stderr
