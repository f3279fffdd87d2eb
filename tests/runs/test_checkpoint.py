"""Atomic checkpoints: publish, prune, verify, and fall back past damaged ones."""

from __future__ import annotations

import errno
import json
import os
import shutil
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


def test_prune_keeps_the_newest_and_the_resumed_one(tmp_path: Path) -> None:
    # 3 checkpoints left by a kill before pruning; resuming from step 1 with keep_last=1 keeps
    # the newest (step 3) and step 1, and removes step 2 and a torn save's staging
    saver = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        saver.save(step, writer(bytes([step])))
    (tmp_path / ".tmp-step-000004-77").mkdir()
    CheckpointManager(tmp_path, keep_last=1).prune(keep=tmp_path / "step-000001")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000003"]


def test_kill_mid_prune_leaves_no_torn_checkpoint(tmp_path: Path, monkeypatch) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        mgr.save(step, writer(bytes([step])))
    real_rmtree = shutil.rmtree

    def killed_midway(path: Path, ignore_errors: bool = False) -> None:
        if "step-000001" not in str(path):  # e.g. the save clearing its own staging
            return real_rmtree(path, ignore_errors=ignore_errors)
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()  # one file gone...
        raise KeyboardInterrupt  # ...then the kill

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(3, writer(b"three"))  # prunes step 1
    # every step-* left is whole; the half-deleted step 1 is hidden staging
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    assert all(verify(p) is None for p in tmp_path.glob("step-*"))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    mgr.prune(keep=tmp_path / "step-000003")  # the next prune removes it
    assert not list(tmp_path.glob(".tmp-*"))


def test_saved_files_get_the_mode_of_a_normal_write(tmp_path: Path) -> None:
    def private_writer(tmp: Path) -> None:  # like safetensors: its own file 0600
        os.close(os.open(tmp / "weights.bin", os.O_CREAT | os.O_WRONLY, 0o600))
        (tmp / "state.json").write_text("{}")

    old = os.umask(0o022)
    try:
        path = CheckpointManager(tmp_path).save(1, private_writer)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert modes == {"weights.bin": 0o644, "state.json": 0o644, "manifest.json": 0o644}


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


# -- a full disk (issue 48, item 8): a real tmpfs that fills up ----------------------------


def torch_writer(numel: int):
    """Write a checkpoint the way the train backends do: torch.save of a float32 tensor."""
    import torch

    def write(tmp: Path) -> None:
        torch.save(torch.ones(numel), tmp / "optimizer.pt")

    return write


def test_full_disk_mid_torch_save_is_an_oserror_and_keeps_the_previous(
    tmp_path: Path, small_fs
) -> None:
    """torch.save on a full disk raises RuntimeError('... unexpected pos ...'), not OSError:
    the save confirms the disk is full and raises ENOSPC naming the checkpoint, with its
    staging removed, and step 1 still whole and `latest`."""
    root = small_fs.mount(tmp_path / "disk", 1 << 20)
    mgr = CheckpointManager(root / "checkpoints", keep_last=2)
    mgr.save(1, torch_writer(100_000))  # 400 kB of 1 MiB
    with pytest.raises(OSError) as err:
        mgr.save(2, torch_writer(200_000))  # 800 kB more: does not fit
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(
        root / "checkpoints" / "step-000002"
    )
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own error, kept for --debug
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert (root / "checkpoints" / "latest").read_text() == "step-000001\n"
    found = mgr.find_resumable()
    assert found is not None and found.step == 1 and found.skipped == []
    assert small_fs.free(root) > 500_000  # the partial 800 kB were given back


def test_a_bug_in_a_checkpoint_writer_stays_a_bug(tmp_path: Path, small_fs) -> None:
    root = small_fs.mount(tmp_path / "disk", 4 << 20)

    def buggy(tmp: Path) -> None:
        torch_writer(1000)(tmp)
        raise RuntimeError("unexpected pos 576 vs 534")  # torch's words, but space is left

    mgr = CheckpointManager(root, keep_last=2)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        mgr.save(1, buggy)
    assert list(root.iterdir()) == []  # no staging left behind either
