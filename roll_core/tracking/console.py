"""The terminal view of a run: a rich progress bar, eval results and time splits above it.

On a terminal the bar shows ``description  bar  step/total  elapsed  eta  loss .. reward ..``
and refreshes in place; it advances on every step (`ConsoleTracker.tick`), logged or not.
The metrics it shows are the ones each pipeline is judged by, whichever are present
(`bar_metrics`): loss (SFT, DPO, distillation), reward and accuracy (RLVR), success rate and
episode return (agentic), KL and entropy (RL), tokens/s. The ETA is the mean time of the
steps since the first one this process ran, times the steps left: it shows from the second
step on, and a first step slowed by compilation or warm-up does not skew it.

When the console is not a terminal (CI, a pipe, a log file, a subprocess) nothing is redrawn:
a plain line with the same content is printed on logged steps every ``plain_every`` steps
(about 20 lines per run by default), on the last step and at close. Either way, eval metrics are printed as one
line without repeats (`eval_metrics`), and RL steps get a time split line every
``time_split_every`` steps (`time_split_line`)::

    step 200  eval/accuracy 0.74  eval/response_length_mean 5.1
    time step 10: rollout 3.21s 62% (reward 0.40s)  log-probs 0.80s 15%  train 1.00s 19% ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from .base import Scalar
from .terminal import is_live, make_console

TOKENS_PER_S_KEY = "perf/tokens_per_s"
EVAL_PREFIX = "eval/"
PLAIN_LINES_PER_RUN = 20

BAR_METRICS: tuple[tuple[str, str], ...] = (
    ("loss", "train/loss"),
    ("reward", "rollout/reward_mean"),
    ("success", "rollout/success_rate"),
    ("return", "rollout/episode_return"),
    ("kl", "actor/kl_loss"),
    ("kl", "actor/reward_kl"),
    ("entropy", "actor/entropy"),
)
"""(label, metric key) shown on the bar when the step logged them; accuracy is added by
`bar_metrics` from ``reward/<domain>/accuracy``. A label is shown once (the first key wins)."""

SUMMARY_KEYS: tuple[str, ...] = (
    "eval/exact_match",
    "eval/accuracy",
    "eval/success_rate",
    "eval/rewards/accuracy",
    "eval/loss",
    "eval/kl",
    "rollout/success_rate",
    "rollout/reward_mean",
    "train/loss",
)
"""Metrics kept in meta.json and shown by `roll runs` / at the end of a run, best first."""

TIME_SPLIT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rollout", ("time/rollout",)),
    ("log-probs", ("time/reference", "time/old_log_prob")),
    ("values", ("time/values",)),
    ("train", ("time/train",)),
    ("sync", ("sync/suspended_s", "sync/seconds")),
    ("offload", ("time/offload", "time/reload")),
)
"""(label, keys) of the parts of an RL step (`offload`: colocated roles moving state off and
back on their devices, docs/scaling.md). Keys are summed, except for sync where the first
present wins (``sync/suspended_s`` includes ``sync/seconds``)."""


class ConsoleTracker:
    """A progress bar over ``total_steps`` that shows each step's key metrics."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        console: Console | None = None,
        *,
        description: str = "train",
        plain_every: int | None = None,
        time_split_every: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or make_console(stderr=True)
        self.total_steps = total_steps
        self.description = description
        self.plain_every = plain_every or max(1, total_steps // PLAIN_LINES_PER_RUN)
        self.time_split_every = time_split_every
        self._clock = clock
        self._live = is_live(self.console)
        self._shown: dict[str, str] = {}
        self._start_step = start_step
        self._last_step = start_step
        self._last_printed = start_step
        self._last_split = start_step
        self._started = clock()
        self._first: tuple[int, float] | None = None  # (step, time) of the first step seen
        self._progress = _make_progress(self.console)
        self._task: TaskID = self._progress.add_task(
            description, total=total_steps, completed=start_step, metrics="", eta="-:--:--"
        )
        self._closed = False
        if self._live:
            self._progress.start()

    @property
    def live_progress(self) -> Progress | None:
        """The bar's live display while it is on screen (phases draw into it), else None."""
        return self._progress if self._live and not self._closed else None

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Advance the bar to ``step`` with its metrics; print eval and time split lines."""
        evals = eval_metrics(metrics)
        if evals:
            self._print(f"step {step}  {format_metrics(evals)}")
        due = self.time_split_every and step - self._last_split >= self.time_split_every
        split = time_split_line(step, metrics) if due else None
        if split:
            self._print(split)
            self._last_split = step
        self._shown.update(bar_metrics(metrics))
        self._advance(step, logged=True)

    def tick(self, step: int) -> None:
        """Advance the bar to ``step``: a step that logged nothing still moves the bar and the
        ETA (off a terminal no line is printed for it: its metrics would be stale)."""
        self._advance(step, logged=False)

    def _advance(self, step: int, *, logged: bool) -> None:
        now = self._clock()
        if step > self._start_step and (self._first is None or step <= self._first[0]):
            self._first = (step, now)  # the first step this process ran: ETA from the next
        self._last_step = step
        self._progress.update(
            self._task, completed=step, metrics=self._metrics_text(), eta=_clock_text(self.eta())
        )
        due = step % self.plain_every == 0 or step >= self.total_steps
        if not self._live and due and logged and step > self._start_step:
            self._print_plain()

    def eta(self) -> float | None:
        """Seconds left: mean step time since the first step seen x steps left (None at first)."""
        if self._first is None or self._last_step <= self._first[0]:
            return None
        first_step, first_time = self._first
        per_step = (self._clock() - first_time) / (self._last_step - first_step)
        return per_step * max(0, self.total_steps - self._last_step)

    def close(self) -> None:
        """Stop the bar (off a terminal: print the last step if it was not printed yet)."""
        if self._closed:
            return
        self._closed = True
        if self._live:
            self._progress.stop()
        elif self._last_step != self._last_printed:
            self._print_plain()

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _metrics_text(self) -> str:
        """``loss 1.234  reward 0.5  tok/s 5,678``: the latest value of each shown metric."""
        order = [label for label, _ in BAR_METRICS]
        labels = sorted(self._shown, key=lambda x: _bar_rank(x, order))
        return "  ".join(f"{label} {self._shown[label]}" for label in labels)

    def _print_plain(self) -> None:
        """One status line: ``train 20/100  elapsed 0:00:12  eta 0:00:48  loss 1.23``."""
        parts = [
            f"{self.description} {self._last_step}/{self.total_steps}",
            f"elapsed {_clock_text(self._clock() - self._started)}",
            f"eta {_clock_text(self.eta())}",
            self._metrics_text(),
        ]
        self._print("  ".join(part for part in parts if part))
        self._last_printed = self._last_step


def bar_metrics(metrics: Mapping[str, Scalar]) -> dict[str, str]:
    """Label -> formatted value of the step's key metrics (see `BAR_METRICS`), in bar order.

    Accuracy comes from ``reward/<domain>/accuracy``: ``acc`` for one domain, ``acc/<domain>``
    for each of several.
    """
    shown: dict[str, str] = {}
    for label, key in BAR_METRICS:
        if key in metrics and label not in shown:
            shown[label] = format_value(metrics[key])
        if label == "reward":
            accs = {
                k.split("/")[1]: v
                for k, v in metrics.items()
                if k.startswith("reward/") and k.endswith("/accuracy") and k.count("/") == 2
            }
            for domain, value in accs.items():
                shown["acc" if len(accs) == 1 else f"acc/{domain}"] = format_value(value)
    if TOKENS_PER_S_KEY in metrics:
        shown["tok/s"] = f"{metrics[TOKENS_PER_S_KEY]:,.0f}"
    return shown


def _bar_rank(label: str, order: list[str]) -> int:
    """Bar position of a label: `BAR_METRICS` order, accuracy after reward, tok/s last."""
    if label == "tok/s":
        return len(order) + 1
    if label.startswith("acc"):
        return order.index("reward")
    return order.index(label) if label in order else len(order)


SCORE_NAMES = ("accuracy", "mean", "reward_mean")
"""Last key parts that name the same score of an eval (with one reward domain, ``eval/accuracy``,
``eval/reward_mean``, ``eval/math/accuracy`` and ``eval/math/mean`` are one number)."""


def eval_metrics(metrics: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The ``eval/`` metrics worth a console line, in the order logged: no bookkeeping (counts,
    timings, zero error counts) and no score twice. Of the `SCORE_NAMES` keys under one prefix,
    the first equal value is kept (``accuracy`` first); a per-domain score equal to an overall
    one is dropped (with one reward domain, ``eval/math/accuracy`` is ``eval/accuracy``)."""
    evals = {k: v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
    order = list(evals)

    def rank(key: str) -> tuple[int, int, int]:
        name = key.rsplit("/", 1)[-1]
        score = SCORE_NAMES.index(name) if name in SCORE_NAMES else len(SCORE_NAMES)
        return key.count("/"), score, order.index(key)

    kept: dict[str, Scalar] = {}
    seen: dict[str, list[Scalar]] = {}  # prefix -> score values kept under it
    for key in sorted(evals, key=rank):
        value = evals[key]
        prefix, name = key.rsplit("/", 1)
        if name in ("count", "time_ms") or name.endswith("_s"):
            continue
        if name in ("errors", "timeouts") and not value:
            continue
        if name in SCORE_NAMES:
            overall = seen.get(EVAL_PREFIX.rstrip("/"), [])
            if value in seen.get(prefix, []) or (prefix != "eval" and value in overall):
                continue
            seen.setdefault(prefix, []).append(value)
        kept[key] = value
    return {k: kept[k] for k in order if k in kept}


def summary_metrics(metrics: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The `SUMMARY_KEYS` present in ``metrics``, best first (meta.json, the final line)."""
    return {k: metrics[k] for k in SUMMARY_KEYS if k in metrics}


def key_metric(metrics: Mapping[str, Scalar]) -> str:
    """``eval/accuracy 0.742``: the best `SUMMARY_KEYS` entry of a run ('' when none)."""
    summary = summary_metrics(metrics)
    return format_metrics(dict([next(iter(summary.items()))])) if summary else ""


def time_split_line(step: int, metrics: Mapping[str, Scalar]) -> str | None:
    """``time step 10: rollout 3.21s 62% (reward 0.40s)  train 1.00s 19% ... = 5.21s``.

    Shares are of the sum of the parts shown; reward scoring overlaps generation, so it is
    shown inside rollout, not as a part. None when the step logged no part (SFT, DPO).
    """
    parts: list[tuple[str, float]] = []
    for label, keys in TIME_SPLIT:
        present = [float(metrics[k]) for k in keys if k in metrics]
        if present:
            parts.append((label, present[0] if label == "sync" else sum(present)))
    total = sum(seconds for _, seconds in parts)
    if not parts or total <= 0:
        return None
    texts = []
    for label, seconds in parts:
        text = f"{label} {seconds:.2f}s {100 * seconds / total:.0f}%"
        if label == "rollout" and "rollout/reward_s" in metrics:
            text += f" (reward scoring {float(metrics['rollout/reward_s']):.2f}s, overlapped)"
        texts.append(text)
    return f"time step {step}: " + "  ".join(texts) + f"  = {total:.2f}s"


def format_metrics(metrics: Mapping[str, Scalar]) -> str:
    """``eval/loss 1.23  eval/exact_match 0.45`` (keys in the order given)."""
    return "  ".join(f"{key} {format_value(value)}" for key, value in metrics.items())


def format_eval_line(step: int, metrics: Mapping[str, Scalar]) -> str:
    """``step 200  eval/loss 1.23  eval/exact_match 0.45`` (keys in the order given)."""
    return f"step {step}  {format_metrics(metrics)}"


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
        TextColumn("eta {task.fields[eta]}", markup=False),
        TextColumn("{task.fields[metrics]}", markup=False),
        console=console,
        refresh_per_second=4,
    )


def _clock_text(seconds: float | None) -> str:
    """``0:01:05`` for 65 s; ``-:--:--`` when unknown (no step time measured yet)."""
    if seconds is None:
        return "-:--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
