"""The gymnasium adapter (gymnasium is optional: `pip install 'roll[gym]'`)."""

from __future__ import annotations

import pytest

from roll_core.envs import make_env
from roll_core.envs.gym_adapter import GymFrozenLake
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


class _LakeWithPhrases(GymFrozenLake):
    """gymnasium's FrozenLake with action names of several words, digits, `_` and `-`."""

    action_names = ("move_left", "Down 2", "Pick up", "up")


@pytest.mark.parametrize(
    ("answer", "action", "obs"),
    [
        ("<answer>Pick up</answer>", "Pick up", "SPFF"),  # longest match: not "up"
        ("I will PICK   UP.", "Pick up", "SPFF"),
        ("<answer>up</answer>", "up", "PFFF"),
        ("move_left", "move_left", "PFFF"),
        ("down 2", "Down 2", "SFFF\nPHFH"),
    ],
)
def test_action_names_of_any_shape_parse(answer: str, action: str, obs: str) -> None:
    env = _LakeWithPhrases()
    env.reset(0)
    observation, _, _, _, info = env.step(answer)
    assert info["action_is_valid"] and info["action"] == action
    assert observation.startswith(obs)


@pytest.mark.parametrize(
    "answer", ["move left", "down 22", "pick up or up", "uppick", "<answer></answer>"]
)
def test_action_names_match_whole_and_once(answer: str) -> None:
    env = _LakeWithPhrases()
    env.reset(0)
    assert not env.step(answer).info["action_is_valid"]


@pytest.mark.parametrize(
    ("names", "message"),
    [(("Left", " LEFT "), "two action names that read the same"), (("Left", " "), "empty")],
)
def test_action_names_that_cannot_parse_are_refused(names: tuple[str, ...], message: str) -> None:
    bad = type("BadLake", (GymFrozenLake,), {"action_names": names})
    with pytest.raises(ConfigError, match=message):
        bad()
