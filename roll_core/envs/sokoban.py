"""Sokoban: push every box onto a target, in rooms generated to be solvable.

Rooms are made the way gym-sokoban (Schrader 2018) makes them, which is also what RAGEN
trains on: a random walk carves the floor, the boxes start *on* their targets, and the player
plays the game backwards (moving, and pulling a box when one is behind), so every room reached
is solvable. The forward solution is the reversed path with each move inverted; it is kept as
:attr:`SokobanEnv.reference_solution`. The reverse walk is capped at ``max_steps`` moves, so
every generated room is solvable within the episode's step budget. Of the states the walk
visits, the one whose boxes moved farthest from their targets is the puzzle.

Departures from gym-sokoban: reverse play is a few random walks (gym-sokoban searches all
pull sequences to a depth), the score is the boxes' total distance from their targets (latest
state on ties), and the player's moves are text. With the defaults (6x6, one box) the shortest
solutions of seeds 0-199 take 1 to 7 moves (median 2, mean 2.7).

Rules are the standard ones: a move into a wall does nothing, a move into a box pushes it when
the cell behind it is free (no wall, no box), boxes are never pulled. Rewards follow
gym-sokoban: ``step_penalty`` per move, ``+box_on_target_reward`` for a box pushed onto a target
(and minus that for one pushed off), ``+solved_reward`` when every box is on a target, which
ends the episode.

The text grid uses the XSB symbols with ``_`` for the floor::

    #  wall     _  floor    .  target    $  box    *  box on a target    @  you    +  you on a target

With ``obs_mode=image`` the room is a picture instead (:func:`roll_core.envs.grid.grid_image`):
dark grey walls, light grey floor, green targets, a brown square for a box and a blue one for
you (on a green cell: on a target); the text says what happened and lists the moves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field, model_validator

from roll_core.envs.base import TextEnv, Transition
from roll_core.envs.grid import (
    ARROW_KEYS,
    MOVES,
    RGB,
    GridOptions,
    Pos,
    grid_image,
    parse_move,
    picture_caption,
    shift,
)
from roll_core.envs.registry import register_env
from roll_core.errors import ConfigError

if TYPE_CHECKING:
    from PIL.Image import Image

OPPOSITE = {"Up": "Down", "Down": "Up", "Left": "Right", "Right": "Left"}
SYMBOLS = {"wall": "#", "floor": "_", "target": ".", "box": "$", "box_on_target": "*"}
_PLAYER, _PLAYER_ON_TARGET = "@", "+"
#: Colours of the picture (obs_mode=image): floors fill a cell, a box or you a centred square.
PALETTE: dict[str, RGB] = {
    "wall": (90, 90, 90),
    "floor": (225, 225, 225),
    "target": (60, 190, 90),
    "box": (160, 95, 30),
    "player": (40, 80, 220),
}

# Floor stamps of the carving walk (gym-sokoban's masks); each covers the centre cell, so the
# carved floor is connected.
_MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
_P_CHANGE_DIRECTION = 0.35
_WALKS = 5  # reverse walks per room; the best state of all of them is kept
_ATTEMPTS = 200


@dataclass(frozen=True)
class Room:
    """An immutable Sokoban state. Positions are ``(row, column)``; cells outside are walls."""

    height: int
    width: int
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos

    def blocked(self, pos: Pos) -> bool:
        """True for a wall or a cell outside the room."""
        r, c = pos
        return not (0 <= r < self.height and 0 <= c < self.width) or pos in self.walls

    def move(self, move: str) -> tuple[Room, str]:
        """The room after ``move`` and what happened: ``moved``, ``pushed`` or ``blocked``."""
        to = shift(self.player, move)
        if self.blocked(to):
            return self, "blocked"
        if to in self.boxes:
            beyond = shift(to, move)
            if self.blocked(beyond) or beyond in self.boxes:
                return self, "blocked"
            return replace(self, player=to, boxes=(self.boxes - {to}) | {beyond}), "pushed"
        return replace(self, player=to), "moved"

    @property
    def boxes_on_target(self) -> int:
        """Number of boxes standing on a target."""
        return len(self.boxes & self.targets)

    @property
    def solved(self) -> bool:
        """True when every box is on a target."""
        return self.boxes == self.targets

    def render(self) -> str:
        """The room as text (see the module docstring for the symbols)."""
        lines = []
        for r in range(self.height):
            row = []
            for c in range(self.width):
                p = (r, c)
                if p in self.walls:
                    row.append(SYMBOLS["wall"])
                elif p == self.player:
                    row.append(_PLAYER_ON_TARGET if p in self.targets else _PLAYER)
                elif p in self.boxes:
                    row.append(SYMBOLS["box_on_target" if p in self.targets else "box"])
                else:
                    row.append(SYMBOLS["target" if p in self.targets else "floor"])
            lines.append("".join(row))
        return "\n".join(lines)

    def image(self, cell_px: int) -> Image:
        """The room as a picture (see :data:`PALETTE`)."""
        floors = [
            [
                "wall" if (r, c) in self.walls else "target" if (r, c) in self.targets else "floor"
                for c in range(self.width)
            ]
            for r in range(self.height)
        ]
        things = {pos: "box" for pos in self.boxes} | {self.player: "player"}
        return grid_image(floors, things, PALETTE, cell_px)

    @classmethod
    def from_text(cls, text: str) -> Room:
        """Parse a room in the text format (``_`` or a space for floor; rows separated by
        newlines or ``/``); ValueError if bad."""
        rows = text.strip("\n").replace("/", "\n").split("\n")
        height, width = len(rows), max((len(r) for r in rows), default=0)
        walls, targets, boxes, players = set(), set(), set(), []
        for r, line in enumerate(rows):
            for c, ch in enumerate(line.ljust(width, "#")):
                p = (r, c)
                if ch == "#":
                    walls.add(p)
                elif ch in ".*+":
                    targets.add(p)
                if ch in "$*":
                    boxes.add(p)
                elif ch in "@+":
                    players.append(p)
                elif ch not in "#._ ":
                    raise ValueError(f"room: unknown symbol {ch!r} at row {r}, column {c}")
        if len(players) != 1:
            raise ValueError(f"room: needs exactly one player (@ or +), found {len(players)}")
        if not boxes or len(boxes) != len(targets):
            raise ValueError(
                f"room: needs as many boxes ($ or *) as targets (. * or +) and at least one; "
                f"found {len(boxes)} boxes and {len(targets)} targets"
            )
        return cls(
            height, width, frozenset(walls), frozenset(targets), frozenset(boxes), players[0]
        )


def solve(room: Room, *, max_states: int = 200_000) -> list[str] | None:
    """A shortest move sequence that solves ``room`` (breadth-first search), or None.

    None means unsolvable, or not solved within ``max_states`` distinct states.
    """
    if room.solved:
        return []
    start = (room.player, room.boxes)
    parent: dict[tuple[Pos, frozenset[Pos]], tuple[tuple[Pos, frozenset[Pos]], str] | None]
    parent = {start: None}
    queue = deque([room])
    while queue:
        current = queue.popleft()
        key = (current.player, current.boxes)
        for move in MOVES:
            nxt, outcome = current.move(move)
            nkey = (nxt.player, nxt.boxes)
            if outcome == "blocked" or nkey in parent:
                continue
            parent[nkey] = (key, move)
            if nxt.solved:
                path, node = [], parent[nkey]
                while node is not None:
                    path.append(node[1])
                    node = parent[node[0]]
                return path[::-1]
            if len(parent) >= max_states:
                return None
            queue.append(nxt)
    return None


def generate_room(
    rng: np.random.Generator, *, width: int, height: int, num_boxes: int, depth: int
) -> tuple[Room, list[str]]:
    """A solvable room and a solution of at most ``depth`` moves, by reverse play.

    Raises ValueError when no room with a moved box is found in a few hundred attempts (a
    room too small for its boxes).
    """
    for _ in range(_ATTEMPTS):
        floor = _carve(rng, height, width)
        cells = [(int(r), int(c)) for r, c in zip(*np.nonzero(floor), strict=True)]
        if len(cells) < num_boxes + 2:
            continue
        found = _reverse_play(rng, floor, cells, num_boxes, depth)
        if found is not None:
            return found
    raise ValueError(
        f"no solvable {width}x{height} room with {num_boxes} boxes found in {_ATTEMPTS} attempts"
    )


def _carve(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    floor = np.zeros((height, width), dtype=bool)
    moves = list(MOVES.values())
    direction = moves[int(rng.integers(4))]
    r, c = int(rng.integers(1, height - 1)), int(rng.integers(1, width - 1))
    for _ in range(int(1.5 * (height + width))):
        if rng.random() < _P_CHANGE_DIRECTION:
            direction = moves[int(rng.integers(4))]
        r = min(max(r + direction[0], 1), height - 2)
        c = min(max(c + direction[1], 1), width - 2)
        mask = np.array(_MASKS[int(rng.integers(len(_MASKS)))], dtype=bool)
        floor[r - 1 : r + 2, c - 1 : c + 2] |= mask
    floor[[0, -1], :] = False
    floor[:, [0, -1]] = False
    return floor


def _reverse_play(
    rng: np.random.Generator, floor: np.ndarray, cells: list[Pos], num_boxes: int, depth: int
) -> tuple[Room, list[str]] | None:
    """Random reverse walks from the solved state; the state with the boxes farthest from
    their targets (the latest such state, so the player may have walked away) wins."""
    picks = rng.choice(len(cells), size=num_boxes + 1, replace=False)
    targets = [cells[int(i)] for i in picks[:num_boxes]]
    names = list(MOVES)
    best: tuple[int, list[str], tuple[Pos, ...], Pos] | None = None  # score, path, boxes, player
    for _ in range(_WALKS):
        boxes = list(targets)  # box i starts on target i
        player = cells[int(picks[-1])]
        path: list[str] = []
        for _ in range(depth):
            move = names[int(rng.integers(4))]
            to = shift(player, move)
            if not floor[to] or to in boxes:
                continue
            behind = shift(player, OPPOSITE[move])
            if behind in boxes:  # pull the box behind the player
                boxes[boxes.index(behind)] = player
            player = to
            path.append(move)
            score = sum(
                abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets, strict=True)
            )
            if set(boxes) != set(targets) and (best is None or score >= best[0]):
                best = (score, list(path), tuple(boxes), player)
    if best is None:
        return None
    _, path, best_boxes, best_player = best
    height, width = floor.shape
    walls = frozenset((r, c) for r in range(height) for c in range(width) if not floor[r, c])
    room = Room(height, width, walls, frozenset(targets), frozenset(best_boxes), best_player)
    solution, state = [], room
    for move in (OPPOSITE[m] for m in reversed(path)):  # stop where it is first solved
        state, _ = state.move(move)
        solution.append(move)
        if state.solved:
            break
    return room, solution


class SokobanOptions(GridOptions):
    """Options of the Sokoban env."""

    width: int = Field(6, ge=5, le=20, description="Room width in cells, outer walls included.")
    height: int = Field(6, ge=5, le=20, description="Room height in cells, outer walls included.")
    num_boxes: int = Field(1, ge=1, le=8, description="Boxes (and targets) in a generated room.")
    search_depth: int = Field(
        30,
        ge=1,
        description="Moves of reverse play when generating a room (more: harder rooms); "
        "capped at max_steps, so every room is solvable within the episode.",
    )
    step_penalty: float = Field(-0.1, description="Reward of every valid move.")
    box_on_target_reward: float = Field(
        1.0,
        description="Reward for pushing a box onto a target (its negative for pushing one off).",
    )
    solved_reward: float = Field(10.0, description="Reward when every box is on a target.")
    room: str | None = Field(
        None,
        description="A fixed room in the text format (rows separated by newlines or /) "
        "instead of generated ones; the seed is then unused.",
    )

    @model_validator(mode="after")
    def _check(self) -> SokobanOptions:
        if self.room is not None:
            Room.from_text(self.room)  # ValueError -> a readable option error
        elif 3 * self.num_boxes + 1 > (self.width - 2) * (self.height - 2):
            raise ValueError(
                f"{self.num_boxes} boxes do not fit in a {self.width}x{self.height} room "
                f"({(self.width - 2) * (self.height - 2)} inner cells); make the room larger "
                "or use fewer boxes"
            )
        return self


@register_env
class SokobanEnv(TextEnv):
    """Sokoban with generated, solvable rooms (see the module docstring)."""

    name = "sokoban"
    Options = SokobanOptions
    key_actions = ARROW_KEYS
    options: SokobanOptions
    instructions = (
        "You are playing Sokoban. Push every box onto a target.\n"
        "Symbols: # wall, _ floor, . target, $ box, * box on a target, @ you, + you on a target.\n"
        "Each turn, move one cell: Up, Down, Left or Right. Walking into a box pushes it if the "
        "cell behind it is free; boxes cannot be pulled.\n"
        "Answer with the move only, like <answer>Left</answer>."
    )
    #: The instructions with ``obs_mode=image``.
    image_instructions = (
        "You are playing Sokoban. Push every box onto a target.\n"
        "Each turn you see a picture of the room, one square per cell: dark grey wall, light "
        "grey floor, green target, a brown square a box, a blue square you (a square on a green "
        "cell stands on a target).\n"
        "Each turn, move one cell: Up, Down, Left or Right. Walking into a box pushes it if the "
        "cell behind it is free; boxes cannot be pulled.\n"
        "Answer with the move only, like <answer>Left</answer>."
    )

    room: Room
    _start: Room  # the room at reset
    _solution: list[str] | None
    _solved_start = False  # whether _solution is known for _start

    @property
    def system_prompt(self) -> str:
        return self.image_instructions if self.options.obs_mode == "image" else self.instructions

    @property
    def reference_solution(self) -> list[str] | None:
        """A solution of the room as it was at reset (None: none found).

        Generated rooms come with theirs; for a ``room=`` level it is searched (BFS, up to
        200k states) on first use only, so a reset never runs the solver.
        """
        if not self._solved_start:
            self._solution, self._solved_start = solve(self._start), True
        return self._solution

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        o = self.options
        if o.room is not None:
            room = Room.from_text(o.room)
            if not (self._solved_start and room == self._start):  # the same level: keep it
                self._start, self._solved_start = room, False
            self.room = room
        else:
            try:
                self.room, self._solution = generate_room(
                    rng,
                    width=o.width,
                    height=o.height,
                    num_boxes=o.num_boxes,
                    depth=min(o.search_depth, o.max_steps),
                )
            except ValueError as err:
                raise ConfigError(
                    f"env sokoban: {err}.",
                    hint="Use a larger room, fewer boxes or a larger search_depth/max_steps.",
                ) from None
            self._start, self._solved_start = self.room, True
        info = {"boxes_on_target": self.room.boxes_on_target, "num_boxes": len(self.room.boxes)}
        return self._view(), info

    def parse_action(self, text: str) -> str:
        return parse_move(text)

    def on_step(self, action: str) -> Transition:
        o = self.options
        before = self.room.boxes_on_target
        self.room, outcome = self.room.move(action)
        delta = self.room.boxes_on_target - before
        solved = self.room.solved
        reward = (
            o.step_penalty + o.box_on_target_reward * delta + (o.solved_reward if solved else 0.0)
        )
        if outcome == "blocked":
            feedback = f"{action} is blocked; nothing moved."
        elif outcome == "pushed":
            feedback = f"You pushed a box {action}." + (
                " It is on a target." if delta > 0 else " It left a target." if delta < 0 else ""
            )
        else:
            feedback = f"You moved {action}."
        if solved:
            feedback += " Every box is on a target: solved!"
        info = {
            "action": action,
            "outcome": outcome,
            "boxes_on_target": self.room.boxes_on_target,
            "success": solved,
        }
        return Transition(f"{feedback}\n{self._view()}", reward, solved, info)

    def render(self) -> str:
        return self.room.render()

    def render_image(self) -> Image | None:
        if self.options.obs_mode != "image":
            return None
        return self.room.image(self.options.cell_px)

    def invalid_observation(self, reason: str) -> str:
        if self.options.obs_mode == "image":  # the caption lists the moves
            return f"Invalid action: {reason}.\n{self._view()}"
        return super().invalid_observation(reason)

    def _view(self) -> str:
        """The room in an observation: the text grid, or (image mode) a caption."""
        if self.options.obs_mode == "image":
            return picture_caption("room")
        return self.room.render()

    def valid_actions(self) -> list[str]:
        return list(MOVES)

    def solve(self, *, max_states: int = 200_000) -> list[str] | None:
        """A shortest solution from the current state (BFS), or None."""
        return solve(self.room, max_states=max_states)

    def expert_action(self) -> str | None:
        """The first move of a shortest solution from the current state (BFS), or None when the
        room can no longer be solved (a box pushed into a corner) or the search gave up."""
        solution = self.solve()
        return solution[0] if solution else None
