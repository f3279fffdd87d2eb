"""The `Tracker` protocol every metrics sink implements, and the spec the registry builds from.

Step convention shared by every tracker: ``step`` counts completed training steps, so the first
step a fresh run logs is 1. ``start_step`` is the step a run resumes from (the step of the
checkpoint it loaded): everything up to and including it is kept, the run logs steps above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rich.console import Console

Scalar = float | int
"""A metric value as trackers receive it: a plain Python number."""


@runtime_checkable
class Tracker(Protocol):
    """A sink for per-step scalar metrics (a file, a progress bar, a dashboard)."""

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Record ``metrics`` (namespaced keys such as ``train/loss``) for ``step``."""
        ...

    def close(self) -> None:
        """Flush and release everything; calling it twice is harmless."""
        ...


@dataclass(frozen=True)
class TrackerSpec:
    """Everything a registry entry may need to build its tracker for one run."""

    run_dir: Path
    run_name: str
    project: str
    config: dict[str, Any]
    total_steps: int
    start_step: int = 0
    time_split_every: int | None = None
    console: Console | None = field(default=None, compare=False)
