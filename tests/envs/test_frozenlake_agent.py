"""examples/agents/frozenlake_agent.py, the FrozenLake agent of recipes/tiny-frozenlake-agent.yaml:
its lake rules, rewards and what it sends, played against a scripted stand-in for the openai
client (the endpoint itself is tested in tests/rollout/test_agent_endpoint.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _agent() -> Any:
    spec = importlib.util.spec_from_file_location(
        "frozenlake_agent_under_test", ROOT / "examples/agents/frozenlake_agent.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fl = _agent()


class ScriptedClient:
    """``client.chat.completions.create`` answering each call with the next scripted move
    (``None``: a reply with no tool call), recording the messages of every call."""

    def __init__(self, moves: list[str | None]) -> None:
        self.moves = list(moves)
        self.sent: list[list[Any]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, *, model: str, messages: list[Any], tools: Any) -> Any:
        assert tools == fl.TOOLS
        self.sent.append(list(messages))
        move = self.moves.pop(0)
        calls = None
        if move is not None:
            args = json.dumps({"direction": move})
            fn = SimpleNamespace(name="move", arguments=args)
            calls = [SimpleNamespace(id=f"call_{len(self.sent)}", function=fn)]
        message = SimpleNamespace(role="assistant", content=None, tool_calls=calls)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def play(
    lake: list[str], moves: list[str | None], **options: Any
) -> tuple[dict[str, Any], ScriptedClient]:
    client = ScriptedClient(moves)
    task = {"seed": 0, "lake": lake, "max_turns": 4, **options}
    return asyncio.run(fl.run(client, task)), client


LAKE = ["SFF", "FHF", "FFG"]


def test_the_shortest_route_is_a_success_and_each_result_is_the_lake() -> None:
    result, client = play(LAKE, ["right", "right", "down", "down"])
    assert result == {"reward": 1.0, "success": True}
    assert client.sent[0] == [{"role": "user", "content": "PFF/FHF/FFG"}]
    # the 4th call resends all: user, then (assistant, tool) per move so far
    assert [m["content"] for m in client.sent[3] if isinstance(m, dict)] == [
        "PFF/FHF/FFG",
        "SPF/FHF/FFG",
        "SFP/FHF/FFG",
        "SFF/FHP/FFG",
    ]


def test_partial_credit_holes_edges_and_replies_that_are_not_moves() -> None:
    # the hole at (1, 1): 0 on the second move; no fourth call is made
    assert play(LAKE, ["down", "right"])[0] == {"reward": 0.0, "success": False}
    # into the edge stays put: up, left, then (1, 0) -> (2, 0): 2 cells closer, 0.1 + 0.2
    result, client = play(LAKE, ["up", "left", "down", "down"])
    assert result["success"] is False and abs(result["reward"] - 0.3) < 1e-9
    assert client.sent[2][-1]["content"] == "PFF/FHF/FFG"
    # a reply without a move ends the episode with 0, even after progress
    assert play(LAKE, ["right", None])[0] == {"reward": 0.0, "success": False}
    # a direction outside the enum is answered with an error and costs the turn
    result, client = play(LAKE, ["north", "right", "right", "down"])
    assert client.sent[1][-1]["content"].startswith("error: direction is one of left")
    assert abs(result["reward"] - 0.4) < 1e-9  # at (1, 2): 3 cells closer


def test_make_task_is_the_seeds_and_always_has_a_path() -> None:
    assert fl.make_task(7) == fl.make_task(7)
    lakes = {tuple(fl.make_task(seed)["lake"]) for seed in range(200)}
    assert len(lakes) > 10
    for lake in lakes:
        assert lake[0][0] == "S" and lake[2][2] == "G" and fl._has_path(list(lake))
    assert fl.make_task(3, size=4, max_turns=6)["max_turns"] == 6


def test_expert_is_a_random_move_repeatable_per_seed_and_turn() -> None:
    task = fl.make_task(5)
    moves = {
        fl.expert({**task, "seed": s}, [{}] * k)["tool_calls"][0]["arguments"]["direction"]
        for s in range(20)
        for k in (1, 3)
    }
    assert moves == set(fl.DIRECTIONS)
    assert fl.expert(task, [{}]) == fl.expert(task, [{}])


def test_history_lake_sends_only_the_current_lake_and_scores_zero_one() -> None:
    opts = {"history": "lake", "partial_credit": False, "max_turns": 6}
    result, client = play(LAKE, ["right", "up", "right", "down", "down"], **opts)
    assert result == {"reward": 1.0, "success": True}
    # every call is one user message: the lake as it is now (the up move hit the edge)
    assert client.sent == [
        [{"role": "user", "content": lake}]
        for lake in ["PFF/FHF/FFG", "SPF/FHF/FFG", "SPF/FHF/FFG", "SFP/FHF/FFG", "SFF/FHP/FFG"]
    ]
    # on the ice after the last move: 0 without partial credit (0.3 with it)
    assert play(LAKE, ["down", "down"], **{**opts, "max_turns": 2})[0]["reward"] == 0.0
    assert abs(play(LAKE, ["down", "down"], max_turns=2)[0]["reward"] - 0.3) < 1e-9
    task = fl.make_task(4, history="lake")
    assert fl.expert(task, [{"role": "user", "content": "PFF/FHF/FFG"}]) == fl.expert(
        task, [{"role": "user", "content": "PFF/FHF/FFG"}]
    )
    # the expert of history: lake never moves into the edge (from the start: down or right)
    starts = {
        fl.expert(fl.make_task(s, history="lake"), [{"content": "PFF/FHF/FFG"}])["tool_calls"][0][
            "arguments"
        ]["direction"]
        for s in range(40)
    }
    assert starts == {"down", "right"}
    with pytest.raises(ValueError, match="history is 'conversation' or 'lake'"):
        fl.make_task(0, history="window")
