"""FrozenLake maps, moves, rewards and the slippery dynamics."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from roll_core.envs import make_env
from roll_core.envs.frozen_lake import generate_map, has_path, slip_probabilities
from roll_core.errors import ConfigError

LAKE = "SFF\nFHF\nFFG"


def test_moves_holes_goal_and_edges() -> None:
    env = make_env("frozen_lake", map=LAKE)
    obs, _ = env.reset(0)
    assert obs == "PFF\nFHF\nFFG"

    obs, reward, terminated, _, info = env.step("Left")  # off the edge: stay
    assert obs == "You moved Left into the edge and stayed.\nPFF\nFHF\nFFG"
    assert (reward, terminated, info["cell"]) == (0.0, False, "S")

    env.step("Right")
    obs, reward, terminated, _, info = env.step("<answer>down</answer>")  # into the hole
    assert obs == "You moved Down. You fell into a hole.\nSFF\nFPF\nFFG"
    assert (reward, terminated, info["success"]) == (0.0, True, False)

    env.reset(0)
    for move in ["Down", "Down", "Right"]:
        assert env.step(move).reward == 0.0
    _, reward, terminated, _, info = env.step("Right")
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_custom_rewards_and_truncation() -> None:
    env = make_env("frozen_lake", map=LAKE, hole_reward=-1.0, step_reward=-0.01, max_steps=3)
    env.reset(0)
    assert env.step("Left").reward == -0.01
    assert env.step("Up").reward == -0.01
    _, _, terminated, truncated, _ = env.step("Left")
    assert truncated and not terminated
    env.reset(0)
    env.step("Right")
    assert env.step("Down").reward == -1.0


def test_generated_maps_always_have_a_path() -> None:
    for seed in range(60):
        rng = np.random.default_rng(seed)
        size = 3 + seed % 6
        grid = generate_map(rng, size, 0.6)
        assert grid[0][0] == "S" and grid[-1][-1] == "G" and len(grid) == size
        assert has_path(grid)
    assert not has_path(["SH", "HG"])
    assert has_path(["SF", "HG"])
    assert generate_map(np.random.default_rng(0), 4, 1.0) == ["SFFF", "FFFF", "FFFF", "FFFG"]


def test_slip_probabilities_follow_gymnasium() -> None:
    # intended direction 1/3, each perpendicular (1 - 1/3) / 2 = 1/3
    assert slip_probabilities("Up", 1 / 3) == pytest.approx(
        {"Left": 1 / 3, "Up": 1 / 3, "Right": 1 / 3}
    )
    # success_rate 0.5: intended 0.5, perpendiculars 0.25 each; Down's are Left and Right
    assert slip_probabilities("Down", 0.5) == pytest.approx(
        {"Left": 0.25, "Down": 0.5, "Right": 0.25}
    )


def _first_moves(n: int, **options: object) -> collections.Counter[str]:
    env = make_env("frozen_lake", is_slippery=True, **options)
    counts: collections.Counter[str] = collections.Counter()
    for seed in range(n):
        env.reset(seed)
        counts[env.step("Up").info["moved"]] += 1
    return counts


def test_slippery_moves_match_their_probabilities() -> None:
    # Start in the middle of a 3x3 lake and press Up: Up, Left and Right each with p = 1/3.
    # Over n = 3000 episodes each count is Binomial(3000, 1/3): mean 1000, sd
    # sqrt(3000 * 1/3 * 2/3) = 25.8; allow 4 sd = 103.
    counts = _first_moves(3000, map="FFF\nFSF\nFFG")
    assert set(counts) == {"Up", "Left", "Right"}
    for move in ("Up", "Left", "Right"):
        assert abs(counts[move] - 1000) < 103, counts
    # success_rate 0.5, n = 2000: Up ~ 1000 (sd sqrt(2000 * .5 * .5) = 22.4, 4 sd = 90),
    # Left and Right ~ 500 each (sd sqrt(2000 * .25 * .75) = 19.4, 4 sd = 78)
    counts = _first_moves(2000, map="FFF\nFSF\nFFG", success_rate=0.5)
    assert abs(counts["Up"] - 1000) < 90 and abs(counts["Left"] - 500) < 78
    assert abs(counts["Right"] - 500) < 78, counts


def test_slippery_success_probability_on_a_two_cell_lake() -> None:
    # "SG": pressing Right reaches G with p = 1/3; slipping Up or Down hits the edge and stays.
    # n = 3000 episodes of one step: 1000 successes expected, sd 25.8, 4 sd = 103.
    env = make_env("frozen_lake", map="SG", is_slippery=True)
    wins = 0
    for seed in range(3000):
        env.reset(seed)
        wins += env.step("Right").info["success"]
    assert abs(wins - 1000) < 103


def test_seeds_give_identical_slippery_episodes() -> None:
    def episode(seed: int) -> list[str]:
        env = make_env("frozen_lake", size=5, is_slippery=True)
        trace = [env.reset(seed)[0]]
        for move in ["Right", "Down"] * 10:
            if env.done:
                break
            trace.append(env.step(move).observation)
        return trace

    assert episode(3) == episode(3)
    assert len({tuple(episode(s)) for s in range(10)}) > 5


def test_bad_map_and_options() -> None:
    with pytest.raises(ConfigError, match="exactly one S"):
        make_env("frozen_lake", map="FFF\nFFG")
    with pytest.raises(ConfigError, match="unknown symbols"):
        make_env("frozen_lake", map="SX\nFG")
    with pytest.raises(ConfigError, match="option success_rate=2"):
        make_env("frozen_lake", success_rate=2)
    with pytest.raises(
        ConfigError, match="unknown option 'slippery' \\(did you mean 'is_slippery'"
    ):
        make_env("frozen_lake", slippery=True)


def test_expert_action_walks_a_shortest_hole_free_path() -> None:
    env = make_env("frozen_lake", map=LAKE)  # SFF / FHF / FFG: the hole is in the middle
    env.reset(0)
    moves = []
    while not env.done:
        moves.append(env.expert_action())
        env.step(moves[-1])
    # BFS tries Up, Down, Left, Right: the path down the left side is found first
    assert moves == ["Down", "Down", "Right", "Right"] and env.cell == "G"
    env = make_env("frozen_lake", map="SF\nHG")
    env.reset(0)
    assert env.expert_action() == "Right"  # Down is a hole
    env = make_env("frozen_lake", map="SHG")  # the goal cannot be reached
    env.reset(0)
    assert env.expert_action() is None


def test_expert_reaches_the_goal_of_generated_maps() -> None:
    env = make_env("frozen_lake", size=4)
    for seed in range(30):
        env.reset(seed)
        while not env.done:
            env.step(env.expert_action())
        assert env.cell == "G", f"seed {seed}"
