"""`Tracking`: one `log` / `close` call fanned out to every tracker of a run.

Metric values are turned into plain Python numbers first (tensors, numpy scalars), so no
tracker sees a tensor. A tracker that raises is reported once on stderr and dropped for the
rest of the run: a dashboard hiccup must not kill a training run. Critical trackers (the
``metrics.jsonl`` writer, which resume and `roll runs` rely on) are the exception: their
errors propagate.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
from collections.abc import Collection, Mapping
from typing import Any

from .base import Scalar, Tracker


class Tracking:
    """The trackers of one run, by backend name, behind a single `Tracker` interface."""

    def __init__(self, trackers: Mapping[str, Tracker], *, critical: Collection[str] = ()) -> None:
        self._trackers: dict[str, Tracker] = dict(trackers)
        self._critical = frozenset(critical)
        self.disabled: list[str] = []

    @property
    def names(self) -> list[str]:
        """Backends still receiving metrics, in logging order."""
        return list(self._trackers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send ``metrics`` (numbers, 0-d tensors, numpy scalars) for ``step`` to every tracker."""
        step = int(step)
        values = scalar_metrics(metrics)
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.log(step, dict(values))
            except Exception as err:
                if name in self._critical:
                    raise
                self._disable(name, "log", err)

    def live_progress(self) -> Any:
        """The live display of a tracker that has one on screen (the console bar), or None."""
        for tracker in self._trackers.values():
            live = getattr(tracker, "live_progress", None)
            if live is not None:
                return live
        return None

    def tick(self, step: int) -> None:
        """A step that logs nothing: trackers with a ``tick`` (the console bar) advance."""
        for name, tracker in list(self._trackers.items()):
            tick = getattr(tracker, "tick", None)
            if tick is None:
                continue
            try:
                tick(int(step))
            except Exception as err:
                if name in self._critical:
                    raise
                self._disable(name, "tick", err)

    def close(self) -> None:
        """Close every tracker even if one fails; a critical tracker's error is re-raised."""
        error: Exception | None = None
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.close()
            except Exception as err:
                if name in self._critical:
                    error = error or err
                else:
                    _warn(name, "close", err)
        self._trackers.clear()
        if error is not None:
            raise error

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _disable(self, name: str, when: str, err: Exception) -> None:
        tracker = self._trackers.pop(name)
        self.disabled.append(name)
        _warn(name, when, err, disabled=True)
        with contextlib.suppress(Exception):
            tracker.close()


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, Scalar]:
    """``metrics`` with every value a Python int or float (see `to_scalar`)."""
    return {str(key): to_scalar(key, value) for key, value in metrics.items()}


def to_scalar(key: str, value: Any) -> Scalar:
    """A plain number from a number, a one-element tensor or array, or a numpy scalar.

    Integers stay ints (bools become 0/1), everything else becomes a float. Anything that is
    not a single number (a string, a tensor of several elements) is a `TypeError` naming ``key``.
    """
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            plain = item()
        except (ValueError, RuntimeError) as err:
            shape = tuple(getattr(value, "shape", ()))
            raise TypeError(f"metric {key!r} is not a scalar (shape {shape})") from err
        if isinstance(plain, numbers.Real):
            return to_scalar(key, plain)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _warn(name: str, when: str, err: Exception, *, disabled: bool = False) -> None:
    tail = "; it is disabled for the rest of this run" if disabled else ""
    print(
        f"roll: warning: tracker '{name}' failed during {when}: {type(err).__name__}: {err}{tail}",
        file=sys.stderr,
        flush=True,
    )
