"""The gymnasium adapter (gymnasium is optional: `pip install 'roll[gym]'`)."""

from __future__ import annotations

import pytest

from roll_core.envs import make_env
from roll_core.errors import ConfigError

pytest.importorskip("gymnasium")

GYM_LAKE = "roll_core.envs.gym_adapter:GymFrozenLake"


def test_gymnasium_frozen_lake_through_the_text_protocol() -> None:
    env = make_env(GYM_LAKE)
    obs, info = env.reset(0)
    # gymnasium's 4x4 map, the player on the start cell
    assert obs == "PFFF\nFHFH\nFFFH\nHFFG"
    assert info["prob"] == 1
    obs, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
    assert obs == "SPFF\nFHFH\nFFFH\nHFFG" and info["action"] == "Right"
    _, reward, _, _, info = env.step("fly")
    assert reward == -0.1 and not info["action_is_valid"]
    env.reset(0)
    # the path around the holes: Down, Down, Right, Right, Down, Right
    for move in ["Down", "Down", "Right", "Right", "Down"]:
        assert env.step(move).reward == 0.0
    obs, reward, terminated, truncated, info = env.step("Right")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert obs.endswith("HFFP")


def test_gymnasium_options_are_validated_and_seeds_repeat() -> None:
    env = make_env(GYM_LAKE, is_slippery=True, map_name="8x8")
    first = [env.reset(3)[0]] + [env.step("Right").observation for _ in range(3)]
    second = [env.reset(3)[0]] + [env.step("Right").observation for _ in range(3)]
    assert first == second and len(first[0].splitlines()) == 8
    with pytest.raises(ConfigError, match="option map_name='5x5'"):
        make_env(GYM_LAKE, map_name="5x5")
