"""What the grid games share: the four moves, how they are read from text, arrow keys, and
the picture of a grid (``obs_mode=image``).

The picture is ``cell_px`` x ``cell_px`` pixels per cell, each cell filled with the colour of
its floor (wall, floor, target, hole, ...) with a centred square of the colour of what stands
on it (you, a box) leaving a ``cell_px // 4`` border of floor colour, so a box on a target
shows both. Solid colours, no antialiasing: the same grid always gives the same pixels. With
the default 14 px, a cell is one 14x14 vision patch of a Qwen2-VL-style model (a 6x6 Sokoban
room is 84x84 pixels: 36 patches, 9 image tokens after the 2x2 merge).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from roll_core.envs.base import EnvOptions, parse_choice

if TYPE_CHECKING:
    from PIL.Image import Image

RGB = tuple[int, int, int]

Pos = tuple[int, int]

#: Canonical move name -> (row delta, column delta); rows grow downwards.
MOVES: MappingProxyType[str, Pos] = MappingProxyType(
    {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
)

#: Words read as a move anywhere in an answer (case-insensitive).
MOVE_WORDS: MappingProxyType[str, str] = MappingProxyType(
    {
        "up": "Up",
        "north": "Up",
        "down": "Down",
        "south": "Down",
        "left": "Left",
        "west": "Left",
        "right": "Right",
        "east": "Right",
    }
)

#: Whole-answer abbreviations (``U``, ``d``, ...) and WASD-style letters are not accepted
#: inside sentences, only as the whole answer.
MOVE_ALIASES: MappingProxyType[str, str] = MappingProxyType(
    {
        "u": "Up",
        "d": "Down",
        "l": "Left",
        "r": "Right",
        "↑": "Up",
        "↓": "Down",
        "←": "Left",
        "→": "Right",
    }
)

#: Arrow keys for human play.
ARROW_KEYS: MappingProxyType[str, str] = MappingProxyType(
    {"up": "Up", "down": "Down", "left": "Left", "right": "Right"}
)


def parse_move(text: str) -> str:
    """The move named in ``text`` (``Up``/``Down``/``Left``/``Right``); see :func:`parse_choice`."""
    return parse_choice(text, MOVE_WORDS, aliases=MOVE_ALIASES, what="move")


def shift(pos: Pos, move: str) -> Pos:
    """``pos`` moved one cell in direction ``move``."""
    dr, dc = MOVES[move]
    return pos[0] + dr, pos[1] + dc


class GridOptions(EnvOptions):
    """Options the grid games share: how the state is shown to the model."""

    obs_mode: Literal["text", "image"] = Field(
        "text",
        description="`text`: the grid as characters in the observation; `image`: the grid as a "
        "picture (a vision-language model), the text then says only what happened and the moves.",
    )
    cell_px: int = Field(
        14, ge=2, le=64, description="obs_mode=image: pixels per grid cell (square cells)."
    )


def grid_image(
    floors: Sequence[Sequence[str]],
    things: Mapping[Pos, str],
    palette: Mapping[str, RGB],
    cell_px: int,
) -> Image:
    """An RGB picture of a grid: ``floors[r][c]`` names the floor colour of each cell,
    ``things`` the colour of what stands on a cell (drawn as a centred square), both as keys
    of ``palette``. See the module docstring for the layout."""
    from PIL import Image as PILImage

    height, width = len(floors), len(floors[0])
    colours = {name: np.asarray(rgb, dtype=np.uint8) for name, rgb in palette.items()}
    pixels = np.empty((height * cell_px, width * cell_px, 3), dtype=np.uint8)
    for r, row in enumerate(floors):
        for c, name in enumerate(row):
            pixels[r * cell_px : (r + 1) * cell_px, c * cell_px : (c + 1) * cell_px] = colours[name]
    m = cell_px // 4
    for (r, c), name in things.items():
        top, left = r * cell_px + m, c * cell_px + m
        pixels[top : top + cell_px - 2 * m, left : left + cell_px - 2 * m] = colours[name]
    return PILImage.fromarray(pixels)  # uint8 [H, W, 3]: RGB


def picture_caption(what: str) -> str:
    """The text that stands for the grid in an image observation (the legal moves)."""
    return f"The picture shows the {what}. Legal moves: Up, Down, Left, Right."
