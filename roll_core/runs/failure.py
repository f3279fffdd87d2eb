"""What a failed run tells the user: the cause in one paragraph, what was kept, what to do.

`explain_failure` turns the two failures a user can act on but no worker can describe
itself into clear errors: a filesystem error on the run directory (full disk, read-only,
deleted) and a dead worker process. Both name the last good checkpoint and the command that
continues the run once the cause is fixed.

`write_failure` finds the filesystem error behind a failed checkpoint or export write, also
where the writer does not raise an OSError: safetensors raises a SafetensorError that names
the errno (`No space left on device (os error 28)`), `torch.save` a RuntimeError that does not
(`[enforce fail at inline_container.cc:672] . unexpected pos ...`). The latter counts as a
full (or read-only) disk only when `os.statvfs` confirms it on the filesystem being written,
checked before the partial files are deleted; otherwise it stays what it is, a bug to report.
"""

from __future__ import annotations

import errno
import os
import re
import traceback
from pathlib import Path

from roll_core.errors import RollError, RunDirError, WorkerDiedError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_MISSING = (errno.ENOENT, errno.ENOTDIR)
EXPLAINED = frozenset((*_FULL, *_READ_ONLY, *_MISSING))
"""The errnos `explain_failure` turns into a clear RunDirError."""


FULL_MARGIN = 64 * 2**20
"""A filesystem with less space than this left (or under 2% of its size, if that is less) is
full for `write_failure`: a write that ran out of space has used up all but a block or so."""


def write_failure(err: BaseException, where: Path) -> OSError | None:
    """The filesystem error that made writing into `where` fail with `err`, or None when the
    filesystem is fine (the error is a bug, not the disk). Call it before deleting what was
    written: those partial files are what filled the disk."""
    if isinstance(err, OSError):
        return err
    if not isinstance(err, Exception) or isinstance(err, RollError):
        return None  # Ctrl-C, a dead worker, a user error: each reported as itself
    said = _errno_said(err)
    if said is not None:
        return OSError(said, os.strerror(said), str(where))
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        fs = os.statvfs(probe)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(where))
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    if free < min(FULL_MARGIN, size // 50):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    return None


_ERRNO_WORDS = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")
"""An errno a writer names in its message: Rust's io::Error (safetensors: `No space left on
device (os error 28)`) or Python's `[Errno 28]`."""


def _errno_said(err: BaseException) -> int | None:
    """A full- or read-only-disk errno the message of `err` (or of an error it chains) names."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for match in _ERRNO_WORDS.finditer(str(current)):
            code = int(match.group(1) or match.group(2))
            if code in (*_FULL, errno.EROFS):
                return code
        current = current.__cause__ or current.__context__
    return None


def release_files(err: BaseException) -> None:
    """Drop the local variables of the frames `err` (and the errors it chains) came through. A
    writer that failed there (torch's zip writer) still holds its file open, so a partial file
    deleted while the error is alive would keep its space, and a full disk stay full, until the
    run exits: marking it failed in meta.json would fail too. The traceback itself is kept."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _kept(last_checkpoint: str | None) -> str:
    if last_checkpoint is None:
        return "no checkpoint was saved yet, so a resume starts again from step 0"
    return f"the last good checkpoint is {last_checkpoint}; nothing already saved was touched"


def _filesystem(
    err: OSError, run_dir: Path, last_checkpoint: str | None, resume_command: str
) -> RunDirError | None:
    if err.errno not in EXPLAINED:
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
