"""metrics.jsonl: durable lines, torn-tail handling, truncation at resume."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from roll_core.errors import RunDirError
from roll_core.tracking.jsonl import JsonlTracker, read_metrics, truncate_after


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def test_log_writes_one_line_per_call_with_step_time_and_metrics(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    tracker = JsonlTracker(path)
    before = time.time()
    tracker.log(1, {"train/loss": 2.5, "perf/tokens": 128})
    tracker.log(2, {"train/loss": 1.25})
    tracker.close()

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert list(first) == ["step", "time", "train/loss", "perf/tokens"]
    assert first["step"] == 1 and first["train/loss"] == 2.5 and first["perf/tokens"] == 128
    assert before <= first["time"] <= time.time()
    assert json.loads(lines[1])["train/loss"] == 1.25


def test_each_line_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    tracker = JsonlTracker(tmp_path / "m.jsonl")
    tracker.log(1, {"a": 1})
    tracker.log(2, {"a": 2})
    tracker.close()
    assert len(calls) == 2


def test_reopening_appends_and_cuts_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    _write(path, '{"step": 1, "time": 0, "a": 1}\n{"step": 2, "ti')  # killed mid-write
    tracker = JsonlTracker(path)
    tracker.log(2, {"a": 2})
    tracker.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert path.read_text().count("\n") == 2


def test_reserved_keys_and_closed_tracker_raise(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        tracker.log(1, {"time": 3.0})
    tracker.close()
    tracker.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        tracker.log(1, {"a": 1})


def test_read_metrics_skips_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    _write(path, '{"step": 1, "a": 1.5}\n\n{"step": 2, "a": 0.5}\n{"step": 3, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1.5}, {"step": 2, "a": 0.5}]


def test_read_metrics_missing_file_is_empty(tmp_path: Path) -> None:
    assert read_metrics(tmp_path / "nope.jsonl") == []


def test_read_metrics_rejects_damage_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    _write(path, '{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(RunDirError, match="line 2"):
        read_metrics(path)


def test_truncate_after_keeps_steps_up_to_and_including(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    lines = [f'{{"step": {s}, "time": 0, "loss": {s / 10}}}' for s in (1, 2, 3, 4, 5)]
    _write(path, "\n".join(lines) + '\n{"step": 6, "ti')  # 5 whole lines + a torn one

    assert truncate_after(path, 3) == 3
    # Steps 1..3 survive byte for byte; 4, 5 and the torn 6 are gone.
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no temp file left


def test_truncate_after_drops_only_the_torn_line_when_nothing_is_newer(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    _write(path, '{"step": 1}\n{"step": 2}\n{"st')
    assert truncate_after(path, 10) == 2
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_truncate_after_missing_file_is_zero(tmp_path: Path) -> None:
    assert truncate_after(tmp_path / "m.jsonl", 3) == 0
    assert not (tmp_path / "m.jsonl").exists()


def test_truncate_then_resume_has_no_duplicate_steps(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tracker = JsonlTracker(path)
    for step in range(1, 6):
        tracker.log(step, {"loss": float(step)})
    tracker.close()  # run killed after step 5, last checkpoint at step 3

    truncate_after(path, 3)
    tracker = JsonlTracker(path)
    for step in range(4, 7):
        tracker.log(step, {"loss": step + 0.5})
    tracker.close()

    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 4.5, 5.5, 6.5]
