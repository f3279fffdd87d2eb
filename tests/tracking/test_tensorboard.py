"""TensorBoard event files, read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch.utils.tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from roll_core.tracking.tensorboard import TensorBoardTracker  # noqa: E402


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def test_scalars_are_written_and_read_back(tmp_path: Path) -> None:
    tracker = TensorBoardTracker(tmp_path / "tb")
    tracker.log(1, {"train/loss": 2.5, "perf/tokens_per_s": 100})
    tracker.log(2, {"train/loss": 1.25})
    tracker.close()
    tracker.close()

    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert _scalars(tmp_path / "tb", "train/loss") == [(1, 2.5), (2, 1.25)]
    assert _scalars(tmp_path / "tb", "perf/tokens_per_s") == [(1, 100.0)]


def test_resume_purges_the_steps_after_start_step(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    first = TensorBoardTracker(log_dir)
    for step in range(1, 6):
        first.log(step, {"train/loss": float(step)})
    first.close()  # killed after step 5; the checkpoint is at step 3

    resumed = TensorBoardTracker(log_dir, start_step=3)
    for step in (4, 5):
        resumed.log(step, {"train/loss": step + 0.5})
    resumed.close()

    # 1..3 from the first process, 4 and 5 only once, with the re-done values.
    assert _scalars(log_dir, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]
