"""The rollout sources of the RL loop (roll_core/rollout/source.py): what each adapter asks
of its producer around a weight sync, and what a checkpoint holds. The producers here are
recording fakes with the producers' public surface."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.errors import DataError
from roll_core.rollout.producer import Rollout, RolloutProducer
from roll_core.rollout.source import (
    ASYNC_STATE_FILE,
    AgenticSource,
    RLVRSource,
)


class Producer:
    """Records calls; `held` is what its state_dict() returns; `ratio` its
    async_generation_ratio. Its pause is the real producer's (suspend -> block -> resume)."""

    paused = RolloutProducer.paused
    members = SimpleNamespace(unit="prompts")

    def __init__(self, held: dict[str, Any] | None = None, ratio: int = 1) -> None:
        self.calls: list[Any] = []
        self.held = held or {}
        self.ratio = ratio
        self.started = False

    def next_batch(self, step: int) -> Rollout:
        self.started = True
        self.calls.append(("next_batch", step))
        return Rollout(groups=[], metrics={"rollout/wall_s": 1.0})

    def suspend(self) -> None:
        self.calls.append("suspend")

    def resume(self, version: int) -> None:
        self.calls.append(("resume", version))

    def state_dict(self) -> dict[str, Any]:
        return self.held

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(("load", state))

    def close(self) -> None:
        self.calls.append("close")


def test_async_source_pauses_only_once_the_producer_runs() -> None:
    producer = Producer()
    source = RLVRSource(producer, pad_id=0)  # type: ignore[arg-type]
    with source.paused(0) as metrics:  # the first sync: the producer has not started
        producer.calls.append("sync")
    assert producer.calls == ["sync"] and metrics == {}
    source.hold()
    assert producer.calls == ["sync"]  # nothing to hold either
    source.next_batch(1)
    with source.paused(1) as metrics:
        producer.calls.append("sync")
    assert producer.calls[-3:] == ["suspend", "sync", ("resume", 1)]
    assert set(metrics) == {"sync/suspended_s", "async/suspend_s", "async/sync_pause_s"}
    assert metrics["async/sync_pause_s"] >= metrics["async/suspend_s"] >= 0


def test_async_source_resumes_when_the_sync_fails() -> None:
    producer = Producer()
    source = RLVRSource(producer, pad_id=0)  # type: ignore[arg-type]
    source.next_batch(1)
    with pytest.raises(RuntimeError, match="sync broke"), source.paused(1):
        raise RuntimeError("sync broke")
    assert producer.calls[-2:] == ["suspend", ("resume", 1)]


def test_sync_source_reports_no_async_timings_and_refuses_an_empty_step() -> None:
    producer = Producer(ratio=0)
    source = RLVRSource(producer, pad_id=0, step_metrics=lambda: {"reward/x": 2.0})  # type: ignore[arg-type]
    rollout = source.next_batch(3)
    with source.paused(3) as metrics:
        pass
    assert producer.calls == [("next_batch", 3), "suspend", ("resume", 3)]
    assert set(metrics) == {"sync/suspended_s"}  # no async timings
    assert rollout.metrics == {"rollout/wall_s": 1.0}
    assert source.metrics() == {"reward/x": 2.0}
    with pytest.raises(DataError, match="no groups"):
        source.to_batch(rollout.groups)


def test_rlvr_checkpoint_file_only_when_groups_are_held(tmp_path: Path) -> None:
    empty = RLVRSource(Producer(), pad_id=0)  # type: ignore[arg-type]
    empty.save_checkpoint(tmp_path)
    assert not (tmp_path / ASYNC_STATE_FILE).exists()
    held = {"regenerate": [4, 1], "uid": 9}
    RLVRSource(Producer(held), pad_id=0).save_checkpoint(tmp_path)  # type: ignore[arg-type]
    assert (tmp_path / ASYNC_STATE_FILE).exists()
    producer = Producer()
    RLVRSource(producer, pad_id=0).load_checkpoint(tmp_path)  # type: ignore[arg-type]
    assert producer.calls == [("load", held)]


def test_agentic_source_suspends_around_every_sync_once_running() -> None:
    manager = Producer(ratio=0)
    manager.members = SimpleNamespace(take_fault_notes=list)  # type: ignore[attr-defined]
    source = AgenticSource(manager, pad_id=0, mode="trajectory", max_context=8)  # type: ignore[arg-type]
    with source.paused(0) as metrics:
        manager.calls.append("sync")
    assert manager.calls == ["sync"] and metrics == {}  # nothing generated yet
    source.next_batch(1)
    with source.paused(1) as metrics:
        manager.calls.append("sync")
    assert manager.calls[-3:] == ["suspend", "sync", ("resume", 1)]
    assert set(metrics) == {"sync/suspended_s"}
    source.hold()
    assert manager.calls[-1] == "suspend"
    source.close()
    assert manager.calls[-1] == "close"


def test_agentic_source_counts_the_rows_it_leaves_out_and_shows_faults() -> None:
    from roll_core.rollout.agentic import TokenTrace, Trajectory

    def trace(n_prompt: int, n_generated: int) -> TokenTrace:
        t = TokenTrace()
        t.add_context([1] * n_prompt)
        t.add_generated([2] * n_generated, [0.0] * n_generated)
        return t

    class Manager(Producer):
        def __init__(self) -> None:
            super().__init__()
            self.members = SimpleNamespace(take_fault_notes=self.take_fault_notes)

        def next_batch(self, step: int) -> Rollout:
            self.calls.append(("next_batch", step))
            return Rollout(groups=[], metrics={})

        def take_fault_notes(self) -> list[str]:
            self.calls.append("notes")
            return ["training episode of t failed (error): ValueError: x"]

    shown: list[str] = []
    manager = Manager()
    source = AgenticSource(  # type: ignore[arg-type]
        manager, pad_id=0, mode="trajectory", max_context=8, note=shown.append
    )
    source.next_batch(1)
    assert manager.calls == [("next_batch", 1), "notes"]
    assert shown == ["training episode of t failed (error): ValueError: x"]
    # a prompt-only row (3 ids), a row of 7 + 2 = 9 ids > 8, and a row of 4 + 2 ids
    a = Trajectory("t", 0, 0, 0, trace=trace(3, 0))
    b = Trajectory("t", 0, 1, 1, trace=trace(7, 2))
    c = Trajectory("t", 0, 2, 2, trace=trace(4, 2))
    batch = source.to_batch([[a, b, c]])
    assert batch.tensors["input_ids"].shape == (1, 6) and "rows_dropped_too_long" not in batch.meta
    assert source.metrics() == {
        "rollout/rows_dropped_no_generated": 1.0,
        "rollout/rows_dropped_too_long": 1.0,
    }
    assert source.metrics() == {}
