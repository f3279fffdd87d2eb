"""The env protocol's bookkeeping, the registry, dotted paths and option parsing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import Field

from roll_core.envs import (
    EnvOptions,
    EnvStateError,
    InvalidAction,
    StepResult,
    TextEnv,
    Transition,
    extract_answer,
    get_env_class,
    make_env,
    parse_choice,
    parse_option_args,
    registered_envs,
)
from roll_core.envs.registry import describe_options, env_id
from roll_core.envs.sokoban import SokobanEnv
from roll_core.errors import ConfigError


class CountOptions(EnvOptions):
    target: int = Field(3, ge=1, description="Number to reach.")


class CountTo(TextEnv):
    """Say numbers until the target is reached: the smallest complete env."""

    name = "count_to_test"
    Options = CountOptions
    options: CountOptions
    instructions = "Count up."

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict]:
        self.value = int(rng.integers(0, 2))
        return f"at {self.value}", {"start": self.value}

    def parse_action(self, text: str) -> int:
        if not text.strip().isdigit():
            raise InvalidAction(f"{text!r} is not a number")
        return int(text)

    def on_step(self, action: int) -> Transition:
        self.value = action
        done = action >= self.options.target
        return Transition(f"at {action}", 1.0 if done else 0.0, done, {"success": done})

    def render(self) -> str:
        return f"value {self.value}"


def test_protocol_bookkeeping() -> None:
    env = CountTo(target=2, format_penalty=-1.0)
    assert env.system_prompt == "Count up."
    with pytest.raises(EnvStateError, match="before reset"):
        env.step("1")
    obs, info = env.reset(5)
    assert info == {
        "start": env.value,
        "step": 0,
        "success": False,
        "episode_return": 0.0,
        "seed": 5,
    }
    result = env.step("x")
    assert isinstance(result, StepResult) and len(result) == 5
    assert result.reward == -1.0 and result.info["action_is_valid"] is False
    assert result.info["invalid_reason"] == "'x' is not a number"
    assert result.observation.startswith("Invalid action: 'x' is not a number.")
    obs, reward, terminated, truncated, info = env.step("2")
    assert (obs, reward, terminated, truncated) == ("at 2", 1.0, True, False)
    assert info == {"success": True, "action_is_valid": True, "step": 2, "episode_return": 0.0}
    with pytest.raises(EnvStateError, match="after the episode ended"):
        env.step("3")
    again, _ = env.reset(5)  # a reset starts over
    assert again == f"at {env.value}" and env.steps == 0 and not env.done


def test_state_key_groups_equal_states() -> None:
    env = make_env("sokoban", room="######\n#@$_.#\n######")
    env.reset(0)
    start = env.state_key()
    env.step("Up")  # blocked: same state
    assert env.state_key() == start
    env.step("Right")
    assert env.state_key() != start


def test_registry_lists_builtin_envs() -> None:
    assert {"sokoban", "frozen_lake", "tool_use"} <= set(registered_envs())
    assert get_env_class("Frozen-Lake").name == "frozen_lake"
    assert env_id(SokobanEnv) == "sokoban"
    assert env_id(CountTo) == f"{__name__}:CountTo"


def test_unknown_env_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as err:
        make_env("sokobon")
    assert "unknown env 'sokobon'. Did you mean 'sokoban'?" in err.value.message
    assert "frozen_lake, sokoban, swe, tool_use" in err.value.message
    assert "package.module:Class" in (err.value.hint or "")


def test_user_env_by_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_envs_for_test.py").write_text(
        textwrap.dedent(
            """
            from roll_core.envs import TextEnv, Transition
            from roll_core.envs.base import InvalidAction

            class Echo(TextEnv):
                instructions = "Say hi."
                def on_reset(self, rng):
                    return "say hi", {}
                def parse_action(self, text):
                    return text
                def on_step(self, action):
                    ok = action.strip() == "hi"
                    return Transition("bye", float(ok), True, {"success": ok})
                def render(self):
                    return "echo"

            NOT_AN_ENV = 3
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # the current directory is searched, like `python -m`
    env = make_env("my_envs_for_test:Echo", max_steps=4)
    assert env.reset(0) == (
        "say hi",
        {"step": 0, "success": False, "episode_return": 0.0, "seed": 0},
    )
    assert env.step("hi").reward == 1.0
    assert env_id(type(env)) == "my_envs_for_test:Echo"

    with pytest.raises(ConfigError, match="has no 'Ech'") as err:
        get_env_class("my_envs_for_test:Ech")
    assert "TextEnv subclasses in my_envs_for_test: Echo" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="is not a TextEnv subclass"):
        get_env_class("my_envs_for_test:NOT_AN_ENV")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_x'"):
        get_env_class("no_such_module_x:Env")
    with pytest.raises(ConfigError, match="not of the form package.module:Class"):
        get_env_class("my_envs_for_test:")
    (tmp_path / "broken_env_module.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="raised RuntimeError: boom"):
        get_env_class("broken_env_module:X")


def test_option_args_are_yaml_values() -> None:
    assert parse_option_args(
        ["width=7", "is_slippery=true", "map=SF", "p=0.5", "tools=[python]"]
    ) == {
        "width": 7,
        "is_slippery": True,
        "map": "SF",
        "p": 0.5,
        "tools": ["python"],
    }
    with pytest.raises(ConfigError, match="not of the form name=value"):
        parse_option_args(["width"])
    with pytest.raises(ConfigError, match="given twice"):
        parse_option_args(["a=1", "a=2"])


def test_option_errors_name_the_option_and_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        CountTo(targt=4)
    assert err.value.message.startswith(f"env {__name__}:CountTo: unknown option 'targt'")
    assert "did you mean 'target'" in err.value.message
    assert "target=3" in (err.value.hint or "") and "max_steps=20" in (err.value.hint or "")
    with pytest.raises(
        ConfigError, match="option target=0: Input should be greater than or equal to 1"
    ):
        CountTo(target=0)
    names = [row[0] for row in describe_options(CountTo)]
    assert names == ["max_steps", "format_penalty", "end_on_invalid_action", "target"]


def test_answer_extraction_and_choices() -> None:
    assert extract_answer("think <answer>a</answer> more <answer> b </answer>") == "b"
    assert extract_answer("cut off <answer>Left") == "Left"
    assert extract_answer("plain") == "plain"
    choices = {"yes": "Yes", "no": "No"}
    assert parse_choice("Well... <answer>YES</answer>", choices) == "Yes"
    with pytest.raises(InvalidAction, match="names several"):
        parse_choice("yes and no", choices)
    with pytest.raises(InvalidAction, match="is not one of Yes, No"):
        parse_choice("maybe", choices)
    with pytest.raises(InvalidAction, match="empty"):
        parse_choice("<answer></answer>", choices)
