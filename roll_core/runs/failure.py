"""What a failed run tells the user: the cause in one paragraph, what was kept, what to do.

`explain_failure` turns the two failures a user can act on but no worker can describe
itself into clear errors: a filesystem error on the run directory (full disk, read-only,
deleted) and a dead worker process. Both name the last good checkpoint and the command that
continues the run once the cause is fixed.
"""

from __future__ import annotations

import errno
from pathlib import Path

from roll_core.errors import RollError, RunDirError, WorkerDiedError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_MISSING = (errno.ENOENT, errno.ENOTDIR)


def _kept(last_checkpoint: str | None) -> str:
    if last_checkpoint is None:
        return "no checkpoint was saved yet, so a resume starts again from step 0"
    return f"the last good checkpoint is {last_checkpoint}; nothing already saved was touched"


def _filesystem(
    err: OSError, run_dir: Path, last_checkpoint: str | None, resume_command: str
) -> RunDirError | None:
    if err.errno not in (*_FULL, *_READ_ONLY, *_MISSING):
        return None
    where = err.filename or run_dir
    stopped = f"run {run_dir.name} stopped and is marked failed"
    if err.errno in _FULL:
        return RunDirError(
            f"cannot write {where}: the disk is full ({err.strerror}). The {stopped}; "
            f"{_kept(last_checkpoint)}.",
            hint=f"Free space on the disk holding {run_dir} (old runs' checkpoints/ "
            f"directories are the usual suspects; checkpoint.keep_last bounds them), then "
            f"continue with: {resume_command}",
        )
    if err.errno in _READ_ONLY:
        return RunDirError(
            f"cannot write {where}: {err.strerror} (the run directory is read-only or not "
            f"ours). The {stopped}; {_kept(last_checkpoint)}.",
            hint=f"Make {run_dir} and everything in it writable again (or remount the disk "
            f"read-write), then continue with: {resume_command}",
        )
    if run_dir.is_dir():
        return RunDirError(
            f"{where} disappeared while the run was writing it ({err.strerror}). The "
            f"{stopped}; {_kept(last_checkpoint)}.",
            hint=f"Check what deletes files under {run_dir}, then continue with: {resume_command}",
        )
    return RunDirError(
        f"the run directory {run_dir} disappeared while the run was writing it "
        f"({err.strerror}: {where}); its checkpoints went with it.",
        hint="Restore the directory from a backup to resume it, or start a new run.",
    )


def explain_failure(
    err: BaseException,
    *,
    run_dir: Path,
    last_checkpoint: str | None,
    resume_command: str,
    problems: list[str],
) -> RollError | None:
    """A clear error for `err`, or None to let it propagate as it is."""
    out: RollError | None = None
    if isinstance(err, WorkerDiedError):
        out = RollError(
            f"{err.message} The run {run_dir.name} is marked failed; "
            f"{_kept(last_checkpoint)}. Every other worker was stopped.",
            hint=f"If the machine ran out of memory or the process was killed by hand, fix "
            f"that; then continue with: {resume_command}",
        )
    elif isinstance(err, OSError):
        out = _filesystem(err, run_dir, last_checkpoint, resume_command)
    if out is not None and problems:
        out = type(out)(out.message + " Also: " + "; ".join(problems) + ".", hint=out.hint)
    return out
