"""TensorBoard event files through `torch.utils.tensorboard.SummaryWriter`.

On resume (``start_step > 0``) the writer is opened with ``purge_step = start_step + 1``:
TensorBoard then drops every event already on disk at or above that step, so steps re-done
after a kill replace the old curve instead of doubling back over it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .base import Scalar


class TensorBoardTracker:
    """One scalar per metric key, written to event files under ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike[str], start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        purge_step = start_step + 1 if start_step > 0 else None
        self._writer: SummaryWriter | None = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=purge_step
        )

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Add every metric as a scalar at ``step`` and flush (a killed run keeps its curves)."""
        if self._writer is None:
            raise ValueError(f"TensorBoardTracker for {self.log_dir} is closed")
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
