"""What the grid games share: the four moves, how they are read from text, arrow keys."""

from __future__ import annotations

from types import MappingProxyType

from roll_core.envs.base import parse_choice

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
