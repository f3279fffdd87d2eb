"""Where a conversion writes: checks on DST, the staging directory, publishing, failures.

A conversion writes into a staging directory next to DST (``.<name>.tmp-<pid>-<random>``) and
renames it to DST when complete, so DST is either the old content or the whole new model:

* DST may not be SRC, inside it or a parent of it (paths resolved, symlinks followed), so
  ``--overwrite`` can never delete the source; a DST whose parent is a file is a usage error.
* Everything written gets the mode the umask gives a new file or directory (``tempfile.mkdtemp``
  would make DST ``0700`` and safetensors its files ``0600``, unreadable by a serving account).
* SIGTERM (and SIGINT) raise :class:`Interrupted` inside the conversion, whose cleanup removes
  the staging directory; only SIGKILL can leave one, and the next conversion into the same
  parent directory removes staging directories whose process no longer runs.
* ``torch.distributed.checkpoint`` reports every read/write failure as ``CheckpointException``,
  a ``BaseException``; :func:`checkpoint_errors` turns it (and ``OSError``) into a RollError
  that names the file and the cause.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from roll_core.errors import CheckpointError, RollError, UsageError

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")


class Interrupted(RollError):
    """The conversion was stopped by a signal; its staging directory was removed (exit code
    128 + the signal number: 143 for SIGTERM, 130 for SIGINT)."""

    exit_code = 130


def check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse a DST that overlaps SRC, is a file, a symlink, under a file, or is not empty."""
    if dst.is_symlink():
        raise UsageError(
            f"{dst} is a symbolic link (to {os.readlink(dst)}).",
            hint="Pass the directory itself, or a new path.",
        )
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        what = "is" if s == d else "is inside" if s in d.parents else "contains"
        raise UsageError(
            f"DST {dst} {what} SRC {src} ({d} vs {s}); the conversion would overwrite its own "
            "input.",
            hint="Write the converted model to a directory outside the source checkpoint.",
        )
    for parent in d.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(
                    f"cannot create {dst}: {parent} is a file.",
                    hint="Pass a DST whose parent is a directory (or does not exist yet).",
                )
            break
    if d.exists() and not d.is_dir():
        raise UsageError(f"{dst} exists and is a file.", hint="Pass a directory for DST.")
    if d.is_dir() and any(d.iterdir()) and not overwrite:
        raise UsageError(
            f"{dst} is not empty.",
            hint="Pass an empty or new directory, or --overwrite to replace its contents.",
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale(dst: Path) -> list[Path]:
    """Remove staging directories of DST left by a killed conversion (its process is gone).

    An old DST moved aside (``.old-``) by a conversion killed before the new one was in place
    is moved back instead, when DST does not exist.
    """
    removed: list[Path] = []
    if not dst.parent.is_dir():
        return removed
    for p in sorted(dst.parent.iterdir()):
        m = _STAGING.match(p.name)
        if not (m and m["name"] == dst.name and p.is_dir() and not _alive(int(m["pid"]))):
            continue
        if m["kind"] == "old" and not dst.exists():
            p.rename(dst)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _mkdir(dst: Path, kind: str) -> Path:
    """A new directory ``.<dst name>.<kind>-<pid>-<random>`` next to DST (mode by the umask)."""
    while True:
        path = dst.parent / f".{dst.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir(0o777)  # the umask applies, as for any directory the user creates
            return path
        except FileExistsError:
            continue


#: Signals received while :func:`publish` renames (they stop the process after it).
_deferred: list[int] = []
_publishing = False


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    if _publishing:
        _deferred.append(signum)
        return
    error = Interrupted(
        f"stopped by {signal.Signals(signum).name}; the partial output was removed and DST was "
        "left as it was.",
        hint="Run the conversion again.",
    )
    error.exit_code = 128 + signum  # as a shell reports a process ended by the signal
    raise error


@contextmanager
def staging(dst: Path) -> Iterator[Path]:
    """A staging directory for DST, removed on any failure or SIGTERM/SIGINT (not on success:
    :func:`publish` renames it)."""
    with io_errors(f"creating {dst.parent}"):
        dst.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(dst)
        tmp = _mkdir(dst, "tmp")
    main = threading.current_thread() is threading.main_thread()
    previous = {}
    if main:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, _raise_interrupted)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _umask() -> int:
    """The process's umask (read from /proc where there is one: setting it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow_umask(root: Path) -> None:
    """Give everything under ``root`` the mode a new file or directory gets (some writers, e.g.
    safetensors, create their files ``0600``)."""
    mask = _umask()
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def publish(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` to DST; an old DST is moved aside first and removed after.

    A SIGTERM/SIGINT during the renames is held until they are done, then reported (DST then
    holds the new model).
    """
    global _publishing
    with io_errors(f"moving the new model into {dst}"):
        _follow_umask(tmp)
        old = None
        _publishing = True
        try:
            if dst.exists():
                old = _mkdir(dst, "old")
                old.rmdir()
                dst.rename(old)
            tmp.rename(dst)
        finally:
            _publishing = False
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if _deferred:
        signum = _deferred.pop()
        _deferred.clear()
        error = Interrupted(
            f"stopped by {signal.Signals(signum).name} after the conversion completed; {dst} "
            "holds the new model.",
            hint="Nothing to redo.",
        )
        error.exit_code = 128 + signum
        raise error


@contextmanager
def io_errors(action: str) -> Iterator[None]:
    """``OSError`` -> CheckpointError naming the file and the cause."""
    try:
        yield
    except OSError as e:
        raise _os_error(action, e) from e


def _os_error(action: str, e: OSError) -> CheckpointError:
    where = f" ({e.filename})" if e.filename else ""
    hint = "Check the path, its permissions and the free disk space."
    if e.errno == errno.ENOSPC:
        hint = "Free disk space (or write DST to another disk) and run the conversion again."
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "Pass paths you may read (SRC) and write (DST's parent directory)."
    return CheckpointError(f"{action} failed: {e.strerror or e}{where}.", hint=hint)


@contextmanager
def checkpoint_errors(action: str) -> Iterator[None]:
    """``torch.distributed.checkpoint``'s ``CheckpointException`` (a BaseException) and OSError
    -> a RollError: the first RollError or Interrupted inside it is raised as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()] or [e]
        for cause in causes:
            if isinstance(cause, RollError):
                raise cause from None
        cause = causes[0]
        if isinstance(cause, OSError):
            raise _os_error(action, cause) from None
        text = _describe(cause)
        raise CheckpointError(
            f"{action} failed: {text}.",
            hint="The torch_dist files are damaged or incomplete (a truncated or corrupt *.distcp "
            "file); copy the checkpoint again. Rerun with --debug for the traceback.",
        ) from e
    except OSError as e:
        raise _os_error(action, e) from e


def _describe(cause: BaseException) -> str:
    """A one-line cause (torch's unpickling messages advise weights_only=False: not shown)."""
    import pickle

    if isinstance(cause, EOFError):
        return "the file ends early (truncated)"
    if isinstance(cause, pickle.UnpicklingError):
        return "the stored bytes do not decode as a tensor (corrupt)"
    lines = str(cause).strip().splitlines()
    return type(cause).__name__ + (f": {lines[0][:300]}" if lines else "")
