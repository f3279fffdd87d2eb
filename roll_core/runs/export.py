"""The final export (`runs/<id>/final/`), published atomically like a checkpoint.

The model is written into a hidden staging directory next to `final/` (`.tmp-final-<pid>/`),
fsync'ed and renamed into place, so `final/` is either absent, the previous export, or the
complete new one: never a torn model. A staging directory left by a kill is removed by the
next export. A run whose last checkpoint is its last step but whose `final/` is missing (killed
between the two) is finished by `roll resume`, which exports from that checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roll_core.runs.failure import EXPLAINED, release_files, write_failure
from roll_core.runs.run import normal_file_modes

FINAL = "final"


def _fsync_dir_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kill_hook() -> None:
    """Test hook: `ROLL_DEBUG_KILL_IN_EXPORT=1` SIGKILLs this process after the model is
    written into staging and before it is published (the kill-before-export case)."""
    if os.environ.get("ROLL_DEBUG_KILL_IN_EXPORT") == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def stale_staging(dest: Path) -> list[Path]:
    """Staging directories of `dest` left behind by an export that was killed."""
    return sorted(dest.parent.glob(f".tmp-{dest.name}-*"))


def export_atomic(dest: Path, write: Callable[[Path], Any]) -> Path:
    """Call `write(staging_dir)`, then publish it as `dest` (replacing an older `dest`).

    A filesystem error (disk full, read-only; also one a writer reports as a RuntimeError, see
    `write_failure`) is raised as an OSError naming `dest`, with `dest` untouched; the staging
    directory is removed either way.
    """
    for old in stale_staging(dest):
        shutil.rmtree(old, ignore_errors=True)
    staging = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    staging.mkdir(parents=True)
    try:
        write(staging)
        normal_file_modes(staging)  # a model file the writer made 0600 reads like the others
        _kill_hook()
        _fsync_dir_tree(staging)
        if dest.exists():
            previous = dest.with_name(f".old-{dest.name}-{os.getpid()}")
            os.rename(dest, previous)
            os.rename(staging, dest)
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.rename(staging, dest)
    except BaseException as err:
        cause = write_failure(err, staging)  # before the partial files that filled the disk go
        release_files(err)  # the writer's open files: their space comes back
        shutil.rmtree(staging, ignore_errors=True)
        if cause is None or cause.errno not in EXPLAINED:
            raise  # a bug, or an OSError explain_failure does not explain: as it is
        raise OSError(cause.errno, cause.strerror, str(dest)) from err
    return dest
