"""Consoles and tables that read the same on a terminal and off one (CI logs, ``| tee``).

On a terminal rich draws as usual. Off a terminal rich would wrap every line at 80 columns
(or ``$COLUMNS``) and squeeze tables until cells are cut (``jolly-hero…``): a run id or a
path split over two lines cannot be copied or grepped. `make_console` gives a console that
never wraps when its stream is not a terminal, and `print_table` prints plain, aligned text
there instead of a box table, every cell in full::

    out = make_console()
    print_table(out, "runs in runs", ["id", "status"], [["jolly-hero-0421", "finished"]])
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

PLAIN_WIDTH = 100_000
"""Line width off a terminal: wide enough that rich never wraps or cuts a line."""


def make_console(*, stderr: bool = False, highlight: bool = True) -> Console:
    """A rich console on stdout (or stderr) that never wraps or truncates off a terminal."""
    probe = Console(stderr=stderr, highlight=highlight)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, highlight=highlight, soft_wrap=True, width=PLAIN_WIDTH)


def is_live(console: Console) -> bool:
    """Whether ``console`` redraws in place (a real, non-dumb terminal)."""
    return console.is_terminal and not console.is_dumb_terminal


def print_table(
    console: Console,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
) -> None:
    """A rich table on a terminal; off one, ``title`` then left-aligned plain columns.

    Plain columns are separated by two spaces and padded to the widest cell (the last column
    is not padded), so ``awk``/``cut`` and the eye both work and no cell is shortened.
    """
    if is_live(console):
        table = Table(title=title, title_justify="left")
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    cells = [list(columns), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    console.print(title, markup=False, highlight=False, soft_wrap=True)
    for row in cells:
        padded = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        line = "  ".join([*padded, row[-1]]).rstrip()
        console.print(line, markup=False, highlight=False, soft_wrap=True)
