"""The terminal view of a run: a rich progress bar, eval results printed above it.

On a terminal the bar shows ``description  bar  step/total  elapsed  eta  loss .. tok/s ..``
and refreshes in place. When the console is not a terminal (CI, a pipe, a log file, a
subprocess) nothing is redrawn: a plain line with the same content is printed every
``plain_every`` steps (about 20 lines per run by default), on the last step and at close.
Metrics whose key starts with ``eval/`` are printed as one line either way::

    step 200  eval/loss 1.23  eval/exact_match 0.45
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .base import Scalar

TOKENS_PER_S_KEY = "perf/tokens_per_s"
EVAL_PREFIX = "eval/"
PLAIN_LINES_PER_RUN = 20


class ConsoleTracker:
    """A progress bar over ``total_steps`` that picks a few key metrics out of each step."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        console: Console | None = None,
        key_metrics: Sequence[str] = ("train/loss",),
        *,
        description: str = "train",
        plain_every: int | None = None,
    ) -> None:
        self.console = console or Console()
        self.total_steps = total_steps
        self.key_metrics = tuple(key_metrics)
        self.description = description
        self.plain_every = plain_every or max(1, total_steps // PLAIN_LINES_PER_RUN)
        self._live = self.console.is_terminal and not self.console.is_dumb_terminal
        self._shown: dict[str, Scalar] = {}
        self._last_step = start_step
        self._last_printed = start_step
        self._progress = _make_progress(self.console)
        self._task: TaskID = self._progress.add_task(
            description, total=total_steps, completed=start_step, metrics=""
        )
        self._closed = False
        if self._live:
            self._progress.start()

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Advance the bar to ``step``; print eval metrics (and, off a terminal, a status line)."""
        evals = {key: value for key, value in metrics.items() if key.startswith(EVAL_PREFIX)}
        if evals:
            self.console.print(format_eval_line(step, evals), markup=False, highlight=False)
        for key in (*self.key_metrics, TOKENS_PER_S_KEY):
            if key in metrics:
                self._shown[key] = metrics[key]
        self._last_step = step
        self._progress.update(self._task, completed=step, metrics=self._metrics_text())
        if not self._live and (step % self.plain_every == 0 or step >= self.total_steps):
            self._print_plain()

    def close(self) -> None:
        """Stop the bar (off a terminal: print the last step if it was not printed yet)."""
        if self._closed:
            return
        self._closed = True
        if self._live:
            self._progress.stop()
        elif self._last_step != self._last_printed:
            self._print_plain()

    def _metrics_text(self) -> str:
        """``loss 1.234  tok/s 5,678``: the key metrics seen so far, latest values."""
        parts = [
            f"{_short_name(key)} {format_value(self._shown[key])}"
            for key in self.key_metrics
            if key in self._shown
        ]
        if TOKENS_PER_S_KEY in self._shown:
            parts.append(f"tok/s {self._shown[TOKENS_PER_S_KEY]:,.0f}")
        return "  ".join(parts)

    def _print_plain(self) -> None:
        """One status line: ``train 20/100  elapsed 0:00:12  eta 0:00:48  loss 1.23``."""
        task = self._progress.tasks[self._task]
        parts = [
            f"{self.description} {self._last_step}/{self.total_steps}",
            f"elapsed {_clock(task.elapsed)}",
            f"eta {_clock(task.time_remaining)}",
            self._metrics_text(),
        ]
        line = "  ".join(part for part in parts if part)
        self.console.print(line, markup=False, highlight=False)
        self._last_printed = self._last_step


def format_eval_line(step: int, metrics: Mapping[str, Scalar]) -> str:
    """``step 200  eval/loss 1.23  eval/exact_match 0.45`` (keys in the order given)."""
    values = "  ".join(f"{key} {format_value(value)}" for key, value in metrics.items())
    return f"step {step}  {values}"


def format_value(value: Scalar) -> str:
    """A compact number: ints as they are, floats to 4 significant digits."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _make_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}", markup=False),
        console=console,
        refresh_per_second=4,
    )


def _short_name(key: str) -> str:
    """``train/loss`` -> ``loss``: the bar has no room for namespaces."""
    return key.rsplit("/", 1)[-1]


def _clock(seconds: float | None) -> str:
    """``0:01:05`` for 65 s; ``-:--:--`` when unknown (no speed estimate yet)."""
    if seconds is None:
        return "-:--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
