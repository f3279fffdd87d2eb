"""Sokoban rules, rewards, generation and solvability."""

from __future__ import annotations

import pytest

from roll_core.envs import EnvStateError, make_env
from roll_core.envs.sokoban import Room, SokobanEnv, solve
from roll_core.errors import ConfigError

# One box, one free cell, then the target:  # @ $ _ . #
CORRIDOR = "######\n#@$_.#\n######"


def test_push_moves_box_and_player_and_solves() -> None:
    env = make_env("sokoban", room=CORRIDOR)
    obs, info = env.reset(0)
    assert obs == CORRIDOR
    assert info["boxes_on_target"] == 0 and info["num_boxes"] == 1

    obs, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
    # a push onto a floor cell: only the step penalty
    assert reward == pytest.approx(-0.1)
    assert obs.endswith("######\n#_@$.#\n######")
    assert info["outcome"] == "pushed" and info["action_is_valid"]
    assert (terminated, truncated, info["success"]) == (False, False, False)

    obs, reward, terminated, truncated, info = env.step("Right")
    # box onto the last target: -0.1 step + 1.0 box on target + 10.0 solved = 10.9
    assert reward == pytest.approx(10.9)
    assert obs.endswith("#__@*#\n######")
    assert terminated and not truncated and info["success"]
    assert info["boxes_on_target"] == 1
    assert info["episode_return"] == pytest.approx(-0.1 + 10.9)
    with pytest.raises(EnvStateError):
        env.step("Right")


@pytest.mark.parametrize(
    ("room", "move"),
    [
        ("######\n#@$_.#\n######", "Up"),  # a wall above the player
        ("######\n#@$#.#\n#__$.#\n######", "Right"),  # a wall behind the box
        ("#######\n#@$$..#\n#######", "Right"),  # a box behind the box
    ],
)
def test_blocked_moves_change_nothing(room: str, move: str) -> None:
    env = make_env("sokoban", room=room)
    obs, _ = env.reset(0)
    obs, reward, terminated, _, info = env.step(move)
    assert info["outcome"] == "blocked"
    assert obs == f"{move} is blocked; nothing moved.\n{room}"
    assert reward == pytest.approx(-0.1)  # a valid move: the step penalty only
    assert not terminated


def test_box_on_target_accounting_and_pushing_off() -> None:
    # targets (1,2) and (1,5); boxes (1,2) (already on its target) and (1,4)
    room = "#######\n#@*_$.#\n#######"
    env = make_env("sokoban", room=room)
    _, info = env.reset(0)
    assert info["boxes_on_target"] == 1
    _, reward, _, _, info = env.step("Right")
    # pushed off a target: -0.1 step - 1.0 = -1.1
    assert reward == pytest.approx(-1.1)
    assert info["boxes_on_target"] == 0 and info["outcome"] == "pushed"
    assert env.render() == "#######\n#_+$$.#\n#######"


def test_two_boxes_solved_only_when_all_are_on_targets() -> None:
    room = "######\n#@$_.#\n#_$_.#\n######"
    env = make_env("sokoban", room=room)
    env.reset(0)
    rewards = []
    for move in ["Right", "Right", "Left", "Left", "Down", "Right", "Right"]:
        _, reward, terminated, _, info = env.step(move)
        rewards.append(reward)
        if len(rewards) == 2:  # first box on a target, the other not: not solved
            assert info["boxes_on_target"] == 1 and not terminated and not info["success"]
    # -0.1, 0.9 (box on target), four plain moves -0.1 each, 10.9 (box on target + solved)
    assert rewards == pytest.approx([-0.1, 0.9, -0.1, -0.1, -0.1, -0.1, 10.9])
    assert terminated and info["success"]
    assert info["episode_return"] == pytest.approx(11.3)  # 0.9 + 10.9 - 5 * 0.1


def test_invalid_actions_cost_the_format_penalty_and_change_nothing() -> None:
    env = make_env("sokoban", room=CORRIDOR, format_penalty=-0.5)
    env.reset(0)
    obs, reward, terminated, truncated, info = env.step("jump!")
    assert reward == -0.5
    assert (
        not info["action_is_valid"] and "not one of Up, Down, Left, Right" in info["invalid_reason"]
    )
    assert obs.startswith("Invalid action:") and obs.endswith(CORRIDOR)
    assert not terminated and not truncated and info["step"] == 1
    _, _, _, _, info = env.step("up or left")
    assert "several" in info["invalid_reason"]

    ending = make_env("sokoban", room=CORRIDOR, end_on_invalid_action=True)
    ending.reset(0)
    assert ending.step("")[2] is True  # terminated


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("<answer>Up</answer>", "Up"),
        ("I will push the box LEFT.", "Left"),
        ("<think>left is a wall</think><answer> down </answer>", "Down"),
        ("r", "Right"),
        ("north", "Up"),
    ],
)
def test_moves_are_parsed_leniently(text: str, move: str) -> None:
    assert SokobanEnv(room=CORRIDOR).parse_action(text) == move


def test_max_steps_truncates() -> None:
    env = make_env("sokoban", room=CORRIDOR, max_steps=2)
    env.reset(0)
    assert env.step("Up")[3] is False
    _, _, terminated, truncated, _ = env.step("Up")
    assert truncated and not terminated and env.done


@pytest.mark.parametrize(
    ("options", "seeds"),
    [({}, range(100)), ({"width": 7, "height": 7, "num_boxes": 2}, range(40))],
)
def test_generated_rooms_are_solvable_by_their_reverse_path(options: dict, seeds: range) -> None:
    env = make_env("sokoban", **options)
    for seed in seeds:
        obs, info = env.reset(seed)
        assert info["boxes_on_target"] < info["num_boxes"]  # never solved at the start
        reference = list(env.reference_solution or [])
        assert 1 <= len(reference) <= env.options.max_steps
        shortest = solve(env.room)
        assert shortest is not None and len(shortest) <= len(reference)
        for i, move in enumerate(reference):
            _, _, terminated, truncated, info = env.step(move)
            assert terminated == (i == len(reference) - 1), f"seed {seed}, move {i}"
        assert info["success"] and not truncated, f"seed {seed}"


def test_bfs_solver_finds_the_shortest_solution() -> None:
    # the player walks below the box (Down, Right) and pushes it up onto the target
    room = Room.from_text("######\n#_.__#\n#@$__#\n#____#\n######")
    assert solve(room) == ["Down", "Right", "Up"]
    stuck = Room.from_text("#####\n#@_$#\n#.###\n#####")  # box in a corner off target
    assert solve(stuck) is None


def test_seeds_give_identical_episodes() -> None:
    a, b = make_env("sokoban"), make_env("sokoban")
    moves = ["Up", "Left", "Down", "Right"] * 3
    runs = []
    for env in (a, b, a):  # a fresh env and a reused env agree
        trace = [env.reset(7)[0]]
        for move in moves:
            if env.done:
                break
            trace.append(env.step(move).observation)
        runs.append(trace)
    assert runs[0] == runs[1] == runs[2]
    rooms = {make_env("sokoban").reset(s)[0] for s in range(10)}
    assert len(rooms) >= 8  # seeds give different rooms


def test_bad_options_are_named() -> None:
    with pytest.raises(
        ConfigError, match="unknown option 'boxes' \\(did you mean 'num_boxes'\\?\\)"
    ):
        make_env("sokoban", boxes=2)
    with pytest.raises(ConfigError, match="option num_boxes='many'"):
        make_env("sokoban", num_boxes="many")
    with pytest.raises(ConfigError, match="4 boxes do not fit in a 5x5 room"):
        make_env("sokoban", width=5, height=5, num_boxes=4)
    with pytest.raises(ConfigError, match="exactly one player"):
        make_env("sokoban", room="#####\n#_$.#\n#####")


def test_a_given_room_is_solved_only_when_its_solution_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import roll_core.envs.sokoban as sokoban

    calls: list[Room] = []

    def counting_solve(room: Room, **kw: int) -> list[str] | None:
        calls.append(room)
        return solve(room, **kw)

    monkeypatch.setattr(sokoban, "solve", counting_solve)
    env = make_env("sokoban", room="######\n#_.__#\n#@$__#\n#____#\n######")
    for seed in range(3):
        env.reset(seed)
        env.step("Up")  # the room changes; the reference is still the start's
    assert calls == []  # no BFS on reset
    env.reset(0)
    assert env.reference_solution == ["Down", "Right", "Up"]
    assert env.reference_solution == ["Down", "Right", "Up"] and len(calls) == 1  # cached
    env.reset(1)
    assert env.reference_solution == ["Down", "Right", "Up"] and len(calls) == 1  # same level


def test_expert_action_follows_a_shortest_solution_and_gives_up_when_lost() -> None:
    # the room of the BFS test: Down, Right, Up
    env = make_env("sokoban", room="######\n#_.__#\n#@$__#\n#____#\n######")
    env.reset(0)
    moves = []
    while not env.done:
        moves.append(env.expert_action())
        env.step(moves[-1])
    assert moves == ["Down", "Right", "Up"] and env.room.solved
    # push the box against the right wall: it can then only move up and down column 4,
    # never onto the target at (3, 3), so nothing helps any more
    env = make_env("sokoban", room="######\n#____#\n#@$__#\n#__._#\n######")
    env.reset(0)
    assert env.expert_action() == "Right"
    env.step("Right")
    env.step("Right")
    assert env.expert_action() is None


def test_expert_solves_generated_rooms_in_their_shortest_number_of_moves() -> None:
    env = make_env("sokoban")
    for seed in range(30):
        env.reset(seed)
        shortest = solve(env.room)
        assert shortest is not None
        moves = 0
        while not env.done:
            env.step(env.expert_action())
            moves += 1
        assert env.room.solved and moves == len(shortest), f"seed {seed}"
