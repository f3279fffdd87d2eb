"""``metrics.jsonl``: one JSON object per logged step, durable line by line.

Each line is ``{"step": step, "time": unix_time, **metrics}``. A line is written, flushed and
fsync'ed before `JsonlTracker.log` returns, so a run killed with SIGKILL loses at most the line
being written; that torn last line is skipped by `read_metrics`, dropped by `truncate_after`
and cut off when a tracker reopens the file.

At resume, ``truncate_after(path, start_step)`` must run *before* a tracker opens the file
(`roll_core.tracking.build_tracking` does this), so re-done steps are not logged twice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from roll_core.errors import RunDirError

from .base import Scalar

RESERVED_KEYS = ("step", "time")
"""Keys the tracker writes itself; a metric may not use them."""

_CHUNK = 64 * 1024


class JsonlTracker:
    """Appends one fsync'ed JSON line per `log` call to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_unterminated_tail(self.path)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Append ``{"step", "time", **metrics}`` and make it durable before returning."""
        if self._file is None:
            raise ValueError(f"JsonlTracker for {self.path} is closed")
        clash = [key for key in RESERVED_KEYS if key in metrics]
        if clash:
            raise ValueError(f"metric keys {clash} are reserved in {self.path.name}")
        record = {"step": int(step), "time": time.time(), **metrics}
        try:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:  # name the file: a bare "No space left on device" names none
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        """Close the file; later `log` calls raise."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record in a metrics file, in file order; ``[]`` when the file does not exist.

    A last line that does not parse (torn by a kill) is skipped; a bad line anywhere else
    raises `RunDirError`.
    """
    return [record for _, record in _parse_lines(Path(path))]


def truncate_after(path: str | os.PathLike[str], step: int) -> int:
    """Keep only records with ``step <= step`` (and no torn last line); return how many remain.

    The file is rewritten atomically (temporary file, fsync, `os.replace`), so a crash during
    the rewrite leaves either the old or the new file. A missing file is left missing (0).
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept = [line for line, record in _parse_lines(path) if record["step"] <= step]
    _atomic_write_lines(path, kept)
    return len(kept)


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` pairs of a metrics file, skipping blank lines and a torn last line."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    parsed: list[tuple[str, dict[str, Any]]] = []
    for index, (number, line) in enumerate(numbered):
        record = _parse_record(line)
        if record is not None:
            parsed.append((line, record))
        elif index < len(numbered) - 1:
            raise RunDirError(
                f"{path} line {number} is not a metrics record: {line[:80]!r}",
                hint="The file was edited or damaged; fix or delete that line.",
            )
    return parsed


def _parse_record(line: str) -> dict[str, Any] | None:
    """The record on ``line``, or None when it is not a JSON object with an integer step."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def _atomic_write_lines(path: Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` so readers see the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _drop_unterminated_tail(path: Path) -> None:
    """Cut a last line that has no newline (a write torn by a kill) off ``path``."""
    if not path.exists():
        return
    keep = _terminated_length(path)
    if keep != path.stat().st_size:
        os.truncate(path, keep)


def _terminated_length(path: Path) -> int:
    """Byte length of ``path`` up to and including its last newline (0 when there is none)."""
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        while pos > 0:
            size = min(_CHUNK, pos)
            pos -= size
            f.seek(pos)
            newline = f.read(size).rfind(b"\n")
            if newline >= 0:
                return pos + newline + 1
    return 0
