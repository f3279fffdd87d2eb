"""The atomic final export, failure messages, damaged meta.json, the `latest` fallback note."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from roll_core.errors import RunDirError, WorkerDiedError
from roll_core.runs import CheckpointManager, Run, list_runs
from roll_core.runs.export import export_atomic, stale_staging
from roll_core.runs.failure import explain_failure, write_failure


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


def test_export_on_a_full_disk_is_an_oserror_naming_final(tmp_path: Path, small_fs) -> None:
    """safetensors on a full disk raises its own SafetensorError: the export confirms the disk
    is full and raises ENOSPC naming final/, with the previous export untouched and the
    staging (and its space) gone."""
    import torch
    from safetensors.torch import save_file

    root = small_fs.mount(tmp_path / "disk", 1 << 20)
    dest = root / "final"
    export_atomic(dest, lambda d: save_file({"w": torch.ones(100_000)}, str(d / "m.safetensors")))
    with pytest.raises(OSError) as err:
        export_atomic(
            dest, lambda d: save_file({"w": torch.ones(200_000)}, str(d / "m.safetensors"))
        )
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(dest)
    assert type(err.value.__cause__).__name__ == "SafetensorError"
    assert [p.name for p in root.iterdir()] == ["final"] and stale_staging(dest) == []
    assert (dest / "m.safetensors").stat().st_size > 400_000  # the previous export
    assert small_fs.free(root) > 500_000


def test_write_failure_needs_the_filesystem_to_confirm(tmp_path: Path, small_fs) -> None:
    roomy = small_fs.mount(tmp_path / "roomy", 1 << 20)
    full = small_fs.mount(tmp_path / "full", 256 << 10)
    small_fs.ballast(full / "ballast", 256 << 10)
    assert small_fs.free(full) == 0
    torch_words = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5")
    made = write_failure(torch_words, full / "checkpoints" / ".tmp-step-000002-1")
    assert made is not None and made.errno == errno.ENOSPC
    assert made.filename == str(full / "checkpoints" / ".tmp-step-000002-1")
    assert write_failure(torch_words, roomy / "x") is None  # space left: a bug, as it was
    # safetensors deletes its partial file, but says the errno: no confirmation needed
    rust_words = RuntimeError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")  # fmt: skip
    said = write_failure(rust_words, roomy / "final")
    assert said is not None and said.errno == errno.ENOSPC and said.filename == str(roomy / "final")
    assert write_failure(RuntimeError("[Errno 30] Read-only file system"), roomy).errno == 30
    assert write_failure(RuntimeError("[Errno 2] No such file"), roomy) is None  # maybe a bug
    own = OSError(errno.EIO, "Input/output error")
    assert write_failure(own, roomy) is own  # an OSError says its errno itself
    for not_the_disk in (KeyboardInterrupt(), WorkerDiedError("actor_train", 0, "killed")):
        assert write_failure(not_the_disk, full) is None  # each reported as what it is
    subprocess.run(["mount", "-o", "remount,ro", str(roomy)], check=True)
    read_only = write_failure(torch_words, roomy / "final")
    assert read_only is not None and read_only.errno == errno.EROFS


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
