"""The atomic final export, failure messages, damaged meta.json, the `latest` fallback note."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from roll_core.errors import RunDirError, WorkerDiedError
from roll_core.runs import CheckpointManager, Run, list_runs
from roll_core.runs.export import export_atomic, stale_staging
from roll_core.runs.failure import explain_failure


def test_export_publishes_whole_and_replaces_the_previous(tmp_path: Path) -> None:
    dest = tmp_path / "final"
    (tmp_path / ".tmp-final-999").mkdir()  # left by a killed export
    export_atomic(dest, lambda d: (d / "model.bin").write_text("v1"))
    assert (dest / "model.bin").read_text() == "v1" and stale_staging(dest) == []
    export_atomic(dest, lambda d: (d / "model.bin").write_text("v2"))
    assert (dest / "model.bin").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_export_files_get_the_mode_of_a_normal_write(tmp_path: Path) -> None:
    def write(d: Path) -> None:  # safetensors creates its file 0600; the rest are normal
        os.close(os.open(d / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600))
        (d / "config.json").write_text("{}")

    old = os.umask(0o027)  # a group-readable umask: 0666 less 027 = 0640
    try:
        dest = export_atomic(tmp_path / "final", write)
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in dest.iterdir()} == {
        "model.safetensors": 0o640,
        "config.json": 0o640,
    }


def test_failed_export_leaves_the_previous_one(tmp_path: Path) -> None:
    dest = tmp_path / "final"
    export_atomic(dest, lambda d: (d / "model.bin").write_text("v1"))

    def full_disk(d: Path) -> None:
        (d / "part").write_text("x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        export_atomic(dest, full_disk)
    assert (dest / "model.bin").read_text() == "v1" and stale_staging(dest) == []


def test_explain_failure_messages() -> None:
    run_dir = Path("runs/calm-otter-01")
    common = dict(run_dir=run_dir, resume_command="roll resume calm-otter-01", problems=[])
    died = explain_failure(
        WorkerDiedError("actor_train", 1, "process 7 was killed by SIGKILL"),
        last_checkpoint="step-000004",
        **common,
    )
    assert died is not None
    assert died.message.startswith("worker actor_train rank 1 died (process 7 was killed")
    assert "last good checkpoint is step-000004" in died.message
    assert died.hint and died.hint.endswith("roll resume calm-otter-01")
    full = explain_failure(
        OSError(errno.ENOSPC, "No space left on device", "runs/calm-otter-01/metrics.jsonl"),
        last_checkpoint=None,
        **{**common, "problems": ["closing the trackers failed too (x)"]},
    )
    assert full is not None and "metrics.jsonl: the disk is full" in full.message
    assert "starts again from step 0" in full.message and full.message.endswith("(x).")
    assert explain_failure(OSError(errno.EIO, "I/O"), last_checkpoint=None, **common) is None
    assert explain_failure(ValueError("bug"), last_checkpoint=None, **common) is None


def _run(tmp_path: Path, rid: str) -> Run:
    return Run.create(
        tmp_path, config_yaml="a: 1\n", name="n", pipeline="sft", command=["roll"], recipe=None,
        run_id=rid,
    )  # fmt: skip


def test_damaged_meta_is_one_runs_error(tmp_path: Path) -> None:
    _run(tmp_path, "good-run-01")
    bad = _run(tmp_path, "bad-run-02")
    (bad.dir / "meta.json").write_text("[1, 2")
    assert {r.id for r in list_runs(tmp_path)} == {"good-run-01", "bad-run-02"}
    with pytest.raises(RunDirError, match=r"meta.json is damaged: not valid JSON .* line 1"):
        Run.open(tmp_path, "bad-run-02")
    (bad.dir / "meta.json").write_text(json.dumps([1, 2]))
    with pytest.raises(RunDirError, match="not a JSON object"):
        bad.meta()
    assert Run.open(tmp_path, "good-run-01").meta()["status"] == "running"


def test_missing_or_empty_latest_pointer_is_said(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "checkpoints")
    mgr.save(2, lambda d: (d / "w").write_text("2"))
    mgr.save(4, lambda d: (d / "w").write_text("4"))
    found = mgr.find_resumable()
    assert found is not None and found.step == 4 and found.note is None
    (tmp_path / "checkpoints" / "latest").unlink()
    found = mgr.find_resumable()
    assert found is not None and found.step == 4
    assert found.note and "checkpoints/latest is missing" in found.note
    (tmp_path / "checkpoints" / "latest").write_text("\n")
    found = mgr.find_resumable()
    assert found is not None and found.note and "is empty" in found.note
