"""A tool-calling FrozenLake agent written as plain OpenAI-client code: it never imports roll.

Each task is a random 3x3 lake (the seed's): start ``S`` top-left, goal ``G`` bottom-right,
frozen ``F`` cells and holes ``H``, always with a path (gymnasium's ``generate_random_map``
rule). The agent declares one tool, ``move(direction)``, sends the lake as the user message,
and runs every ``move`` the model calls on its own copy of the lake; each tool result is the
lake again, ``P`` marking the player, rows joined by ``/`` (``SFF/FPH/FFG``). The episode ends
at the goal (reward 1, a success), in a hole, after ``max_turns`` moves, or when the model
answers without a call.

Partial credit (a reward below 1 that is not a success): an episode that ends on the ice gets
``0.1`` plus ``0.1`` per cell the player stands closer to the goal than the start; a hole, or a
reply that is not a move, gets 0. So a model that has not found the goal yet still learns that
a well-formed move beats a broken one, that holes are worse than ice, and which way the goal
lies. Trained with ``roll train agentic recipes/tiny-frozenlake-agent.yaml`` (history
``conversation``) or ``recipes/tiny-frozenlake-agent-lake.yaml`` (history ``lake``, which
learns; docs/agentic.md, "Bring your own agent"); the same file runs against any OpenAI-compatible
server: ``run(openai.AsyncOpenAI(base_url=...), make_task(0))``.

Two ways to talk to the model (``history``, an option of the recipe's ``envs[].options``):

* ``"conversation"``: every call resends the whole conversation (the lake, each call, each tool
  result). The built-in byte-level model has a 512-token context and a call is about 80
  tokens, so four moves fit, exactly the shortest path from corner to corner of a 3x3 lake.
* ``"lake"`` (context management, as many real agents do): every call sends only the current
  lake as the user message (the tools go into the system turn), so each call is short whatever
  the episode's length and the model sees exactly the state it acts in. Such a call does not
  continue the previous one's conversation: with ``rollout.agent_history: segment`` roll
  trains each call as its own sequence carrying the episode's return, and with ``rollout.mode:
  step`` gives each call GiGPO's step-level credit (identical prompts in a group are the same
  state).

``partial_credit: false`` scores 1 at the goal and 0 otherwise, as the env path's FrozenLake.
"""

from __future__ import annotations

import json
import random
from typing import Any

DIRECTIONS = ("left", "down", "right", "up")
STEP = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one cell.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": list(DIRECTIONS)}},
                "required": ["direction"],
            },
        },
    }
]


def _has_path(rows: list[str]) -> bool:
    size = len(rows)
    seen, frontier = {(0, 0)}, [(0, 0)]
    while frontier:
        r, c = frontier.pop()
        if rows[r][c] == "G":
            return True
        for dr, dc in STEP.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and rows[nr][nc] != "H":
                seen.add((nr, nc))
                frontier.append((nr, nc))
    return False


def make_task(
    seed: int,
    size: int = 3,
    p_frozen: float = 0.8,
    max_turns: int = 4,
    history: str = "conversation",
    partial_credit: bool = True,
) -> dict[str, Any]:
    """The task of an episode (roll calls it with the episode's seed and envs[].options): a
    random lake with a path from S to G, resampled until it has one; how the agent talks to
    the model (``history``: ``conversation`` or ``lake``) and is scored."""
    if history not in ("conversation", "lake"):
        raise ValueError(f"history is 'conversation' or 'lake', not {history!r}")
    rng = random.Random(seed)
    while True:
        cells = [
            ["F" if rng.random() < p_frozen else "H" for _ in range(size)] for _ in range(size)
        ]
        cells[0][0], cells[-1][-1] = "S", "G"
        rows = ["".join(row) for row in cells]
        if _has_path(rows):
            return {
                "seed": seed,
                "lake": rows,
                "max_turns": max_turns,
                "history": history,
                "partial_credit": partial_credit,
            }


def view(lake: list[str], pos: tuple[int, int]) -> str:
    """The lake with the player ``P`` at ``pos``, rows joined by ``/``."""
    rows = [list(row) for row in lake]
    rows[pos[0]][pos[1]] = "P"
    return "/".join("".join(row) for row in rows)


def step(lake: list[str], pos: tuple[int, int], direction: str) -> tuple[int, int]:
    """Where ``direction`` takes the player from ``pos`` (a move off the edge stays put)."""
    dr, dc = STEP[direction]
    r, c = pos[0] + dr, pos[1] + dc
    return (r, c) if 0 <= r < len(lake) and 0 <= c < len(lake[0]) else pos


def _score(lake: list[str], pos: tuple[int, int], partial: bool = True) -> dict[str, Any]:
    if lake[pos[0]][pos[1]] == "G":
        return {"reward": 1.0, "success": True}
    if lake[pos[0]][pos[1]] == "H" or not partial:
        return {"reward": 0.0, "success": False}
    progress = pos[0] + pos[1]  # cells closer to the goal than the start
    return {"reward": 0.1 * (1 + progress), "success": False}


async def run(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    lake, pos = task["lake"], (0, 0)
    partial, lake_only = task.get("partial_credit", True), task.get("history") == "lake"
    messages: list[Any] = [{"role": "user", "content": view(lake, pos)}]
    for _ in range(task["max_turns"]):
        if lake_only:  # context management: only the state the model acts in
            messages = [{"role": "user", "content": view(lake, pos)}]
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message)  # the assistant message as returned, unchanged
        if not message.tool_calls:
            return {"reward": 0.0, "success": False}  # not a move: the episode ends
        for call in message.tool_calls:
            try:
                direction = json.loads(call.function.arguments).get("direction")
            except (json.JSONDecodeError, AttributeError):
                direction = None
            if isinstance(direction, str) and direction in STEP:
                pos = step(lake, pos, direction)
                result = view(lake, pos)
            else:
                result = f"error: direction is one of {', '.join(DIRECTIONS)}"
            if lake[pos[0]][pos[1]] in "HG":
                return _score(lake, pos, partial)  # fell into a hole, or reached the goal
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return _score(lake, pos, partial)


def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """The warm start's demonstrations: a uniformly random move (it teaches the call format,
    not the route), drawn from the task's seed and the turn, so the warm start is repeatable.
    ``history: lake``: every call has one message, the lake, so the draw is the seed's and the
    lake's, among the moves that stay on the board (a move into the edge would show the same
    lake again, draw the same move, and fill the demonstrations with the start state)."""
    if task.get("history") != "lake":
        rng = random.Random(task["seed"] * 1000 + len(messages))
        return _move(rng.choice(DIRECTIONS))
    rows = str(messages[-1]["content"]).split("/")
    pos = next((r, row.index("P")) for r, row in enumerate(rows) if "P" in row)
    moves = [d for d in DIRECTIONS if step(rows, pos, d) != pos]
    return _move(random.Random(f"{task['seed']}:{messages[-1]['content']}").choice(moves))


def _move(direction: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "move", "arguments": {"direction": direction}}]}
