"""End-to-end: failures of a run are reported as what they are and leave it finishable.

The real `roll` CLI in a subprocess on the built-in tiny model: a kill between the last
checkpoint and the final export (also one before the older checkpoints are pruned),
filesystem errors on the run directory (a full disk and a read-only disk injected at the
write call by tests/runs/fs_fault.py, a run directory deleted mid-run), a real full disk (a
small tmpfs) at a checkpoint and at the final export, a damaged meta.json and a deleted
`latest` pointer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_cli_env, make_roll, write_tiny_recipe

pytestmark = pytest.mark.slow

FS_FAULT = str(Path(__file__).with_name("fs_fault.py"))


def meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = (load_file(str(p / "final" / "model.safetensors")) for p in (a, b))
    return wa.keys() == wb.keys() and all(
        torch.equal(wa[k].view(-1).view(torch.uint8), wb[k].view(-1).view(torch.uint8)) for k in wa
    )


SHORT = dict(
    trainer={"max_steps": 6, "micro_batch_size": 8, "grad_accum_steps": 1},
    eval={"every_steps": None, "exact_match": False},
    checkpoint={"every_steps": 2, "keep_last": 2},
)


@pytest.fixture
def short_recipe(tiny_recipe):
    """6 steps, a checkpoint every 2, no eval: a couple of seconds per run."""
    return tiny_recipe(**SHORT)


@pytest.fixture(scope="module")
def whole_run(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of the short recipe for the module (the tests only read it or
    copy it): the weights the interrupted runs must end with."""
    directory = tmp_path_factory.mktemp("whole-run")
    recipe = write_tiny_recipe(directory, **SHORT)
    res = make_roll(make_cli_env(cache_dir))("sft", str(recipe), "--run-id", "whole-run-00")
    assert res.returncode == 0, res.stderr
    return directory / "runs" / "whole-run-00"


def test_kill_before_final_export_is_finished_by_resume(
    roll, short_recipe, whole_run: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    # SIGKILL after the model is written into staging, before it is published as final/.
    res = roll(
        "sft", str(short_recipe), "--run-id", "kill-export-01",
        env={"ROLL_DEBUG_KILL_IN_EXPORT": "1"},
    )  # fmt: skip
    assert res.returncode == -signal.SIGKILL
    run_dir = runs / "kill-export-01"
    assert not (run_dir / "final").exists()
    assert list(run_dir.glob(".tmp-final-*"))  # the torn export is hidden, not final/
    assert meta(run_dir)["status"] == "running"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000006"

    res = roll("resume", "kill-export-01", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    assert "step-000006 is the last step" in res.stderr and "finishing it" in res.stderr
    assert meta(run_dir)["status"] == "finished"
    assert not list(run_dir.glob(".tmp-final-*"))
    assert steps_logged(run_dir) == list(range(1, 7))
    assert same_weights(run_dir, whole_run)
    # Now it is finished: a second resume has nothing to do and says so.
    res = roll("resume", "kill-export-01", "--runs-dir", str(runs))
    assert res.returncode == 2 and "nothing to resume" in res.stderr


@pytest.mark.extended  # a third kill point of the same resume machinery
def test_kill_before_prune_then_resume_keeps_keep_last_and_normal_file_modes(
    roll, short_recipe, tmp_path: Path
) -> None:
    """SIGKILL once the last checkpoint (step 6) is published but before the older ones are
    pruned, so before the export: 3 checkpoints with keep_last 2. The resume that finishes
    the run prunes back to 2. Under umask 027 every file of the checkpoints and the export is
    0640, the model weights (safetensors writes 0600) included."""
    runs = tmp_path / "runs"
    old_umask = os.umask(0o027)  # inherited by the CLI subprocesses
    try:
        res = roll(
            "sft", str(short_recipe), "--run-id", "kill-prune-09",
            env={"ROLL_DEBUG_KILL_BEFORE_PRUNE": "6"},
        )  # fmt: skip
        assert res.returncode == -signal.SIGKILL
        ckpts = runs / "kill-prune-09" / "checkpoints"
        names = ["step-000002", "step-000004", "step-000006"]
        assert sorted(p.name for p in ckpts.glob("step-*")) == names
        res = roll("resume", "kill-prune-09", "--runs-dir", str(runs))
    finally:
        os.umask(old_umask)
    assert res.returncode == 0, res.stderr
    assert "finishing it" in res.stderr
    assert sorted(p.name for p in ckpts.glob("step-*")) == names[1:]
    assert not list(ckpts.glob(".tmp-*"))
    final = runs / "kill-prune-09" / "final"
    files = [p for p in [*final.rglob("*"), *ckpts.rglob("*")] if p.is_file()]
    assert final / "model.safetensors" in files
    assert {p.relative_to(runs).as_posix(): p.stat().st_mode & 0o777 for p in files} == {
        p.relative_to(runs).as_posix(): 0o640 for p in files
    }


def test_full_disk_at_metrics_write_is_a_clear_error(
    roll, short_recipe, cli_env, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    # the 3rd line of metrics.jsonl (step 3) hits a full disk; step-000002 was saved
    res = subprocess.run(
        [sys.executable, FS_FAULT, "ENOSPC", "metrics.jsonl", "3",
         "sft", str(short_recipe), "--run-id", "full-disk-02"],
        env=cli_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    err = " ".join(res.stderr.split())
    assert "internal error" not in err and "Traceback" not in err
    assert "metrics.jsonl: the disk is full" in err
    assert "the last good checkpoint is step-000002" in err
    assert "Free space on the disk holding" in err and "roll resume full-disk-02" in err
    run_dir = runs / "full-disk-02"
    assert meta(run_dir)["status"] == "failed"
    assert (run_dir / "checkpoints" / "step-000002" / "manifest.json").is_file()
    # Once space is back, the run resumes from what was kept and finishes.
    res = roll("resume", "full-disk-02", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    assert "resumed from step-000002" in res.stderr
    assert steps_logged(run_dir) == list(range(1, 7))


def test_read_only_meta_is_a_clear_error_and_closing_does_not_raise_again(
    short_recipe, cli_env, tmp_path: Path
) -> None:
    # meta.json becomes unwritable (EROFS) at its 4th write; marking the run failed fails too,
    # which the message says instead of raising a second error from the failure handler.
    res = subprocess.run(
        [sys.executable, FS_FAULT, "EROFS", "meta.json", "4",
         "sft", str(short_recipe), "--run-id", "read-only-03"],
        env=cli_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    err = " ".join(res.stderr.split())
    assert "internal error" not in err and "Traceback" not in err
    assert "read-only-03/meta.json: Read-only file system" in err
    assert "meta.json could not be marked failed" in err
    assert "Make" in err and "writable again" in err and "roll resume read-only-03" in err


def test_run_directory_deleted_mid_run(cli_env, tiny_recipe, tmp_path: Path) -> None:
    recipe = tiny_recipe(
        trainer={"max_steps": 400, "micro_batch_size": 8, "grad_accum_steps": 1},
        eval={"every_steps": None, "exact_match": False},
    )
    run_dir = tmp_path / "runs" / "gone-dir-04"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "roll"), "sft", str(recipe), "--run-id", run_dir.name],
        env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 240
    while not ((run_dir / "metrics.jsonl").exists() and steps_logged(run_dir)):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    shutil.rmtree(run_dir)
    _, stderr = proc.communicate(timeout=120)
    err = " ".join(stderr.split())
    assert proc.returncode == 1, stderr
    assert "internal error" not in err and "Traceback" not in err
    assert f"the run directory {run_dir} disappeared" in err
    assert "Restore the directory from a backup" in err


def test_damaged_meta_is_an_error_for_that_run_only(roll, whole_run: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(whole_run, runs / "good-run-05")  # a finished run
    bad = runs / "bad-meta-06"
    shutil.copytree(runs / "good-run-05", bad)
    (bad / "meta.json").write_text('{"status": "running", "step": ')  # torn by hand
    res = roll("runs", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    assert "good-run-05" in res.stdout and "finished" in res.stdout
    assert "bad-meta-06" in res.stdout and "damaged" in res.stdout
    res = roll("resume", "bad-meta-06", "--runs-dir", str(runs))
    err = " ".join(res.stderr.split())
    assert res.returncode == 1 and "internal error" not in err
    assert "meta.json is damaged: not valid JSON" in err and "resumed from" not in err
    assert "Repair meta.json by hand" in err


def test_deleted_latest_pointer_is_said(roll, whole_run: Path, tmp_path: Path) -> None:
    # a copy of the module's finished run (checkpoints step-4 and step-6; its own 4-step run
    # here cost one more `roll` launch), resumed for 2 more steps each time
    runs = tmp_path / "runs"
    run_dir = Path(shutil.copytree(whole_run, runs / whole_run.name))
    (run_dir / "checkpoints" / "latest").unlink()
    res = roll("resume", run_dir.name, "trainer.max_steps=8", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    err = " ".join(res.stderr.split())
    assert "checkpoints/latest is missing; using the newest complete checkpoint, step-000006" in err
    (run_dir / "checkpoints" / "latest").write_text("")
    res = roll("resume", run_dir.name, "trainer.max_steps=10", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    assert "checkpoints/latest is empty" in " ".join(res.stderr.split())


def _used(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.extended  # a second full-disk point; the metrics-write one runs by default
def test_full_disk_at_checkpoint_and_export_then_resume_is_bitwise(
    roll, short_recipe, whole_run: Path, small_fs, tmp_path: Path
) -> None:
    """A real full disk (a tmpfs with ballast files) under the runs directory (issue 48, item
    8): the step-4 checkpoint does not fit (torch.save fails mid-file), then, once some space
    is freed, the final export does not (safetensors fails); each time a clear error, the run
    marked failed, no staging left, the earlier checkpoint intact. Freed again, `roll resume`
    finishes, bit for bit the weights of an uninterrupted run."""
    ckpt = _used(whole_run / "checkpoints" / "step-000006")
    final = _used(whole_run / "final")
    runs = small_fs.mount(tmp_path / "small", 3 * ckpt + 2 * final)
    # The run gets 1.5 checkpoints of room; deleting ballast-1 gives it 2 checkpoints and half
    # a final model, deleting ballast-2 all the rest.
    small_fs.ballast(runs / "ballast-2", small_fs.free(runs) - (2 * ckpt + final // 2))
    small_fs.ballast(runs / "ballast-1", ckpt // 2 + final // 2)
    run_dir, resume = runs / "full-disk-08", ("resume", "full-disk-08", "--runs-dir", str(runs))

    res = roll("sft", str(short_recipe), "--run-id", run_dir.name, f"runs_dir={runs}")
    err = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "internal error" not in err and "Traceback" not in err
    assert f"cannot write {run_dir}/checkpoints/step-000004: the disk is full" in err
    assert "the last good checkpoint is step-000002" in err
    assert f"roll resume full-disk-08 --runs-dir {runs}" in err
    assert meta(run_dir)["status"] == "failed"
    assert "No space left on device" in meta(run_dir)["error"]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"]  # no .tmp-*
    assert (ckpts / "latest").read_text() == "step-000002\n"

    # Room for two checkpoints: no checkpoint before the last step, and the export fails.
    (runs / "ballast-1").unlink()
    res = roll(*resume, "checkpoint.every_steps=null")
    err = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "resumed from step-000002" in err and "internal error" not in err
    assert f"cannot write {run_dir}/final: the disk is full" in err
    assert "the last good checkpoint is step-000006" in err
    assert meta(run_dir)["status"] == "failed"
    assert sorted(p.name for p in run_dir.glob("*final*")) == []  # no final/, no .tmp-final-*
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002", "step-000006"]

    (runs / "ballast-2").unlink()
    res = roll(*resume)
    assert res.returncode == 0, res.stderr
    assert "step-000006 is the last step" in res.stderr and "finishing it" in res.stderr
    assert meta(run_dir)["status"] == "finished"
    assert steps_logged(run_dir) == list(range(1, 7))
    assert same_weights(run_dir, whole_run)
