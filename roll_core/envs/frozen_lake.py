"""FrozenLake: walk from the start to the goal over a frozen lake without falling into a hole.

Same game as gymnasium's ``FrozenLake-v1`` (maps, dynamics and rewards), in text:

* Maps are random ``size`` x ``size`` grids, each cell frozen with probability ``p_frozen``,
  the start top-left and the goal bottom-right, resampled until a path from start to goal
  exists (gymnasium's ``generate_random_map``). A fixed map can be given with ``map``.
* With ``is_slippery``, a move goes the intended way with probability ``success_rate``
  (gymnasium's default 1/3) and to each of the two perpendicular directions with probability
  ``(1 - success_rate) / 2``. A move off the edge leaves the player in place.
* Reaching the goal gives ``goal_reward`` (1) and ends the episode as a success; a hole gives
  ``hole_reward`` (0) and ends it; other moves give ``step_reward`` (0).

Grid symbols: ``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal, ``P`` you.

With ``obs_mode=image`` the lake is a picture instead (:func:`roll_core.envs.grid.grid_image`):
white start, light blue ice, dark blue holes, a gold goal and a red square for you; the text
says what happened and lists the moves.
"""

from __future__ import annotations

from collections import deque
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

#: Gymnasium's action order; the perpendicular moves of action ``a`` are ``a - 1`` and ``a + 1``.
ACTIONS = ("Left", "Down", "Right", "Up")
_ATTEMPTS = 10_000
#: Colours of the picture (obs_mode=image), by map symbol; ``P`` (you) is a centred square.
PALETTE: dict[str, RGB] = {
    "S": (250, 250, 250),
    "F": (170, 215, 245),
    "H": (20, 40, 110),
    "G": (240, 190, 0),
    "P": (220, 40, 40),
}


def has_path(grid: list[str]) -> bool:
    """True when a goal is reachable from the start over non-hole cells (4-neighbourhood)."""
    height, width = len(grid), len(grid[0])
    start = next((r, c) for r in range(height) for c in range(width) if grid[r][c] == "S")
    seen, frontier = {start}, [start]
    while frontier:
        pos = frontier.pop()
        if grid[pos[0]][pos[1]] == "G":
            return True
        for move in MOVES:
            r, c = shift(pos, move)
            if 0 <= r < height and 0 <= c < width and (r, c) not in seen and grid[r][c] != "H":
                seen.add((r, c))
                frontier.append((r, c))
    return False


def generate_map(rng: np.random.Generator, size: int, p_frozen: float) -> list[str]:
    """A random ``size`` x ``size`` map with a path from S (top-left) to G (bottom-right).

    Raises ValueError when none is found in many attempts (``p_frozen`` far too low).
    """
    for _ in range(_ATTEMPTS):
        cells = np.where(rng.random((size, size)) < p_frozen, "F", "H")
        cells[0, 0], cells[-1, -1] = "S", "G"
        grid = ["".join(row) for row in cells]
        if has_path(grid):
            return grid
    raise ValueError(f"no {size}x{size} map with a path found in {_ATTEMPTS} attempts")


def slip_probabilities(action: str, success_rate: float) -> dict[str, float]:
    """Where a slippery move ``action`` goes, with probabilities (gymnasium's dynamics)."""
    a = ACTIONS.index(action)
    fail = (1.0 - success_rate) / 2.0
    probs: dict[str, float] = {}
    for offset, p in ((-1, fail), (0, success_rate), (1, fail)):
        move = ACTIONS[(a + offset) % 4]
        probs[move] = probs.get(move, 0.0) + p
    return probs


class FrozenLakeOptions(GridOptions):
    """Options of the FrozenLake env."""

    size: int = Field(4, ge=2, le=16, description="Side of a generated square map.")
    p_frozen: float = Field(
        0.8, gt=0.0, le=1.0, description="Probability that a generated cell is frozen (not a hole)."
    )
    is_slippery: bool = Field(False, description="Moves may slip sideways (see success_rate).")
    success_rate: float = Field(
        1.0 / 3.0,
        ge=0.0,
        le=1.0,
        description="On slippery ice, probability of moving the intended way; each perpendicular "
        "way has (1 - success_rate) / 2.",
    )
    goal_reward: float = Field(1.0, description="Reward for reaching the goal.")
    hole_reward: float = Field(0.0, description="Reward for falling into a hole.")
    step_reward: float = Field(0.0, description="Reward of any other move.")
    map: str | None = Field(
        None,
        description="A fixed map instead of generated ones: rows of S F H G separated by "
        "newlines or / (SFF/FHF/FFG), one S; the seed then only drives slipping.",
    )

    @model_validator(mode="after")
    def _check(self) -> FrozenLakeOptions:
        if self.map is not None:
            parse_map(self.map)
        return self


def parse_map(text: str) -> list[str]:
    """Rows of a fixed map (separated by newlines or ``/``); ValueError when it is not a
    rectangle of S F H G with one S."""
    rows = [row.strip() for row in text.strip().replace("/", "\n").split("\n")]
    if not rows or any(len(row) != len(rows[0]) for row in rows) or not rows[0]:
        raise ValueError("map: rows must be non-empty and of equal length")
    bad = sorted({ch for row in rows for ch in row} - set("SFHG"))
    if bad:
        raise ValueError(f"map: unknown symbols {bad}; use S (start), F, H, G")
    flat = "".join(rows)
    if flat.count("S") != 1 or "G" not in flat:
        raise ValueError("map: needs exactly one S and at least one G")
    return rows


@register_env
class FrozenLakeEnv(TextEnv):
    """FrozenLake with random maps that always have a path (see the module docstring)."""

    name = "frozen_lake"
    Options = FrozenLakeOptions
    key_actions = ARROW_KEYS
    options: FrozenLakeOptions
    instructions = (
        "You are on a frozen lake. Reach the goal G without falling into a hole H.\n"
        "Symbols: S start, F frozen ice, H hole, G goal, P you.\n"
        "Each turn, move one cell: Up, Down, Left or Right. The ice may be slippery: you can "
        "slide sideways instead.\n"
        "Answer with the move only, like <answer>Right</answer>."
    )
    #: The instructions with ``obs_mode=image``.
    image_instructions = (
        "You are on a frozen lake. Reach the goal without falling into a hole.\n"
        "Each turn you see a picture of the lake, one square per cell: white start, light blue "
        "ice, dark blue hole, gold goal, a red square you.\n"
        "Each turn, move one cell: Up, Down, Left or Right. The ice may be slippery: you can "
        "slide sideways instead.\n"
        "Answer with the move only, like <answer>Right</answer>."
    )

    grid: list[str]
    player: Pos

    @property
    def system_prompt(self) -> str:
        return self.image_instructions if self.options.obs_mode == "image" else self.instructions

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        o = self.options
        if o.map is not None:
            self.grid = parse_map(o.map)
        else:
            try:
                self.grid = generate_map(rng, o.size, o.p_frozen)
            except ValueError as err:
                raise ConfigError(
                    f"env frozen_lake: {err} (p_frozen={o.p_frozen}).",
                    hint="Raise p_frozen (gymnasium's default is 0.8) or use a smaller map.",
                ) from None
        self.player = next(
            (r, c) for r, row in enumerate(self.grid) for c, ch in enumerate(row) if ch == "S"
        )
        return self._view(), {}

    def parse_action(self, text: str) -> str:
        return parse_move(text)

    def on_step(self, action: str) -> Transition:
        o = self.options
        moved = action
        if o.is_slippery:
            probs = slip_probabilities(action, o.success_rate)
            names = list(probs)
            moved = names[int(self.rng.choice(len(names), p=list(probs.values())))]
        r, c = shift(self.player, moved)
        inside = 0 <= r < len(self.grid) and 0 <= c < len(self.grid[0])
        if inside:
            self.player = (r, c)
        cell = self.cell
        if moved != action:
            feedback = f"You tried {action} but slipped {moved}"
        else:
            feedback = f"You moved {action}"
        feedback += "." if inside else " into the edge and stayed."
        if cell == "H":
            reward, terminated, feedback = o.hole_reward, True, feedback + " You fell into a hole."
        elif cell == "G":
            reward, terminated, feedback = o.goal_reward, True, feedback + " You reached the goal!"
        else:
            reward, terminated = o.step_reward, False
        info = {
            "action": action,
            "moved": moved,
            "slipped": moved != action,
            "cell": cell,
            "success": cell == "G",
        }
        return Transition(f"{feedback}\n{self._view()}", reward, terminated, info)

    @property
    def cell(self) -> str:
        """The map symbol under the player."""
        return self.grid[self.player[0]][self.player[1]]

    def render(self) -> str:
        rows = [list(row) for row in self.grid]
        rows[self.player[0]][self.player[1]] = "P"
        return "\n".join("".join(row) for row in rows)

    def render_image(self) -> Image | None:
        if self.options.obs_mode != "image":
            return None
        return grid_image(self.grid, {self.player: "P"}, PALETTE, self.options.cell_px)

    def invalid_observation(self, reason: str) -> str:
        if self.options.obs_mode == "image":  # the caption lists the moves
            return f"Invalid action: {reason}.\n{self._view()}"
        return super().invalid_observation(reason)

    def _view(self) -> str:
        """The lake in an observation: the text grid, or (image mode) a caption."""
        return picture_caption("lake") if self.options.obs_mode == "image" else self.render()

    def valid_actions(self) -> list[str]:
        return ["Up", "Down", "Left", "Right"]

    def expert_action(self) -> str | None:
        """The first move of a shortest hole-free path to a goal (BFS), or None when no goal
        can be reached. On slippery ice this is the move that *aims* along that path."""
        rows, cols = len(self.grid), len(self.grid[0])
        first: dict[Pos, str | None] = {self.player: None}
        queue = deque([self.player])
        while queue:
            pos = queue.popleft()
            if self.grid[pos[0]][pos[1]] == "G":
                return first[pos]
            for move in MOVES:
                r, c = shift(pos, move)
                inside = 0 <= r < rows and 0 <= c < cols
                if inside and (r, c) not in first and self.grid[r][c] != "H":
                    first[(r, c)] = first[pos] or move
                    queue.append((r, c))
        return None
