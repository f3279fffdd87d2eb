"""Progress for the phases around the training steps: loading, reference log-probs, warm
starts, evaluation. A phase that takes a few seconds must never look like a hang::

    with phase(console, "loading models") :
        clusters = make_clusters(...)
    with phase(console, "warm start", total=4) as p:
        for k in range(4):
            ...
            p.advance()

On a terminal a transient line (spinner, label, ``k/N`` when the total is known, elapsed)
is drawn while the phase runs and replaced by ``label: done in 3.2s``. When the training bar
is already live (evaluation between steps) the phase is drawn as a second line of that bar
(rich allows one live display at a time). Off a terminal nothing is redrawn: the phase prints
``label ...`` when it starts, a ``label k/N`` line about every 10% of a counted phase, and
``label: done in 3.2s`` at the end, so a CI log shows what the run is doing and for how long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from .terminal import is_live

BRIEF_MIN_S = 1.0
"""A ``brief`` phase (one that recurs, like evaluation between steps) prints its summary
line only when it took at least this long, and no start line off a terminal."""

PLAIN_UPDATES = 10
"""Off a terminal, a counted phase prints about this many ``label k/N`` lines."""


class Phase:
    """A running phase: `advance` it as its parts finish (only counted phases need to)."""

    def __init__(
        self,
        console: Console,
        label: str,
        total: int | None,
        progress: Progress | None,
        clock: Callable[[], float],
        brief: bool = False,
    ) -> None:
        self.console = console
        self.brief = brief
        self.label = label
        self.total = total
        self.done = 0
        self._progress = progress
        self._task: TaskID | None = None
        self._clock = clock
        self.started = clock()
        self._last_plain = 0
        if progress is not None:
            self._task = progress.add_task(label, total=total, metrics="", eta="")

    def advance(self, n: int = 1) -> None:
        """``n`` more parts of the phase are finished."""
        self.done += n
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self.done)
            return
        every = max(1, (self.total or 0) // PLAIN_UPDATES)
        if self.total and self.done < self.total and self.done - self._last_plain >= every:
            self._last_plain = self.done
            elapsed = self._clock() - self.started
            self._print(f"{self.label} {self.done}/{self.total}  ({elapsed:.1f}s)")

    def finish(self) -> float:
        """Close the phase's display; returns its duration in seconds."""
        seconds = self._clock() - self.started
        if self._progress is not None and self._task is not None:
            self._progress.remove_task(self._task)
        count = f" ({self.total})" if self.total else ""
        if self.brief and seconds < BRIEF_MIN_S:
            return seconds
        self._print(f"{self.label}{count}: done in {seconds:.1f}s")
        return seconds

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True, style="dim")


@contextmanager
def phase(
    console: Console,
    label: str,
    *,
    total: int | None = None,
    progress: Progress | None = None,
    brief: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Phase]:
    """Show ``label`` while the ``with`` body runs (see the module docstring).

    ``progress`` is a live display already on screen (the training bar) to draw into; without
    one, a terminal gets its own transient display. Nothing is printed for a phase that raised.
    """
    own: Progress | None = None
    if progress is None and is_live(console):
        own = progress = _make_progress(console, counted=total is not None)
        own.start()
    elif progress is None and not brief:
        console.print(f"{label} ...", markup=False, highlight=False, soft_wrap=True, style="dim")
    current = Phase(console, label, total, progress, clock, brief)
    try:
        yield current
    except BaseException:
        if own is not None:
            own.stop()
        raise
    if own is not None:
        own.stop()
        current._progress = None  # the display is gone: print the summary line only
        current._task = None
    current.finish()


def _make_progress(console: Console, *, counted: bool) -> Progress:
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if counted:
        columns += [BarColumn(), MofNCompleteColumn()]
    return Progress(*columns, TimeElapsedColumn(), console=console, transient=True)
