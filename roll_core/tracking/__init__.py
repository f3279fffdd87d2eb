"""Where a run's metrics go: console (rich), metrics.jsonl, TensorBoard, SwanLab, W&B.

`build_tracking` turns ``tracking.backends`` into one `Tracking` object for the driver loop::

    tracking = build_tracking(backends=cfg.tracking.backends, run_dir=run.dir, ...)
    tracking.log(step, {"train/loss": loss, "perf/tokens_per_s": tps})
    tracking.close()

``metrics.jsonl`` in the run directory is always written, listed or not. TensorBoard writes to
``run_dir/tensorboard``, SwanLab (offline, no account) to ``run_dir/swanlab``, W&B (offline
unless ``WANDB_MODE`` is set, only when installed) to ``run_dir/wandb``. Steps count completed
training steps; on resume pass ``start_step`` = the checkpoint's step: metrics.jsonl is cut
back to it and TensorBoard purges the steps after it, so re-done steps are not logged twice.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from roll_core.errors import ConfigError

from .base import Scalar, Tracker, TrackerSpec
from .console import ConsoleTracker
from .fanout import Tracking, scalar_metrics, to_scalar
from .jsonl import JsonlTracker, read_metrics, truncate_after

__all__ = [
    "METRICS_FILE",
    "TRACKERS",
    "ConsoleTracker",
    "JsonlTracker",
    "Scalar",
    "Tracker",
    "TrackerSpec",
    "Tracking",
    "build_tracking",
    "read_metrics",
    "resolve_backends",
    "scalar_metrics",
    "to_scalar",
    "truncate_after",
]

METRICS_FILE = "metrics.jsonl"
ALWAYS_ON = "jsonl"


def _console(spec: TrackerSpec) -> Tracker:
    return ConsoleTracker(
        spec.total_steps,
        start_step=spec.start_step,
        console=spec.console,
        time_split_every=spec.time_split_every,
    )


def _jsonl(spec: TrackerSpec) -> Tracker:
    return JsonlTracker(spec.run_dir / METRICS_FILE)


def _tensorboard(spec: TrackerSpec) -> Tracker:
    from .tensorboard import TensorBoardTracker

    return TensorBoardTracker(spec.run_dir / "tensorboard", start_step=spec.start_step)


def _swanlab(spec: TrackerSpec) -> Tracker:
    from .swanlab_tracker import SwanLabTracker

    return SwanLabTracker(spec.run_dir / "swanlab", spec.project, spec.run_name, spec.config)


def _wandb(spec: TrackerSpec) -> Tracker:
    from .wandb_tracker import WandbTracker

    return WandbTracker(spec.run_dir, spec.project, spec.run_name, spec.config)


TRACKERS: dict[str, Callable[[TrackerSpec], Tracker]] = {
    "console": _console,
    "jsonl": _jsonl,
    "tensorboard": _tensorboard,
    "swanlab": _swanlab,
    "wandb": _wandb,
}
"""Backend name (as written in ``tracking.backends``) -> builder of its tracker."""


def resolve_backends(backends: Sequence[str]) -> list[str]:
    """Validated backend names: jsonl first (always on), then the others once each, in order."""
    unknown = [name for name in backends if name not in TRACKERS]
    if unknown:
        raise _unknown_backend(unknown[0])
    rest = [name for name in dict.fromkeys(backends) if name != ALWAYS_ON]
    return [ALWAYS_ON, *rest]


def build_tracking(
    *,
    backends: Sequence[str],
    run_dir: Path,
    run_name: str,
    project: str,
    config: dict[str, Any],
    total_steps: int,
    start_step: int = 0,
    time_split_every: int | None = None,
    console: Console | None = None,
) -> Tracking:
    """Open every tracker of a run; on resume (``start_step > 0``) cut metrics.jsonl back first.

    Raises `ConfigError` for an unknown backend name or a backend whose package is missing;
    trackers already opened are closed again before the error propagates.
    """
    names = resolve_backends(backends)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if start_step > 0:
        truncate_after(run_dir / METRICS_FILE, start_step)
    spec = TrackerSpec(
        run_dir=run_dir,
        run_name=run_name,
        project=project,
        config=config,
        total_steps=total_steps,
        start_step=start_step,
        time_split_every=time_split_every,
        console=console,
    )
    trackers: dict[str, Tracker] = {}
    try:
        for name in names:
            trackers[name] = TRACKERS[name](spec)
    except BaseException:
        Tracking(trackers).close()
        raise
    return Tracking(trackers, critical=(ALWAYS_ON,))


def _unknown_backend(name: str) -> ConfigError:
    valid = sorted(TRACKERS)
    close = difflib.get_close_matches(name, valid, n=1)
    suggestion = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(
        f"tracking.backends: unknown backend '{name}'.{suggestion}",
        hint=f"Valid backends: {', '.join(valid)}.",
    )
