"""Atomic checkpoints: publish, prune, verify, and fall back past damaged ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.errors import CheckpointError
from roll_core.runs import CheckpointManager, verify


def writer(payload: bytes):
    def write(tmp: Path) -> None:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(payload)
        (tmp / "state.json").write_text(json.dumps({"x": 1}))

    return write


def test_save_publishes_manifest_and_latest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    path = mgr.save(3, writer(b"abc"))
    assert path.name == "step-000003"
    assert (tmp_path / "latest").read_text().strip() == "step-000003"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3
    assert manifest["files"]["sub/weights.bin"]["size"] == 3
    assert verify(path) is None
    assert not list(tmp_path.glob(".tmp-*"))


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, writer(bytes([step])))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]


def test_crash_during_save_leaves_previous_usable(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, writer(b"one"))

    def crash(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"partial")
        raise KeyboardInterrupt  # like a kill mid-write

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, crash)
    found = mgr.find_resumable()
    assert found is not None and found.step == 1 and found.skipped == []


def test_damaged_latest_falls_back(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, writer(b"one"))
    p2 = mgr.save(2, writer(b"two"))
    (p2 / "sub" / "weights.bin").write_bytes(b"tw0")  # same size, different bytes
    found = mgr.find_resumable()
    assert found is not None and found.step == 1
    assert found.skipped == [("step-000002", "sub/weights.bin checksum mismatch")]


def test_truncated_file_detected(tmp_path: Path) -> None:
    p = CheckpointManager(tmp_path).save(1, writer(b"abcdef"))
    (p / "sub" / "weights.bin").write_bytes(b"abc")
    assert verify(p) == "sub/weights.bin has the wrong size"


def test_all_damaged_is_an_error(tmp_path: Path) -> None:
    p = CheckpointManager(tmp_path).save(1, writer(b"x"))
    (p / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="every checkpoint of this run is damaged"):
        CheckpointManager(tmp_path).find_resumable()


def test_no_checkpoint_returns_none(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "none").find_resumable() is None
