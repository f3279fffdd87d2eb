"""The run's rollout records: ``runs/<id>/rollouts/step-000001.jsonl``, one file per step.

A step file's first line is ``{"step": N, "summary": {...}}`` (rows, groups, reward mean, the
finish reasons: what the viewer's timeline needs without reading the rows); each further line
is one recorded row (a dict: tokens, per-token values, reward, ...; the RL loop's
`roll_core.pipelines.rl_records` builds them). A step file is written to a temporary name,
fsync'ed and renamed, so a run killed at any point leaves whole step files only; resuming from
checkpoint step-N deletes the files of steps after N (:meth:`RolloutStore.truncate_after`), so
the record continues as if the run had never stopped. The directory's size is bounded by a
budget (``tracking.rollout_records.max_mb``): a step that would exceed it is not written, and
neither is any later one.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from typing import Any

from roll_core.errors import RunDirError
from roll_core.runs import atomic_write_text

DIRNAME = "rollouts"
_STEP_FILE = re.compile(r"^step-(\d{6,})\.jsonl$")


def step_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}.jsonl"


def _clean(value: Any) -> Any:
    """``value`` with non-finite floats as None (JSON has no NaN / inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def encode_step(step: int, summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The text of one step file (module doc)."""
    lines = [json.dumps({"step": step, "summary": _clean(summary)}, ensure_ascii=False)]
    lines += [json.dumps(_clean(row), ensure_ascii=False, allow_nan=False) for row in rows]
    return "\n".join(lines) + "\n"


class RolloutStore:
    """Writes the step files of one run's ``rollouts/`` directory within a size budget."""

    def __init__(self, run_dir: Path, *, max_mb: float) -> None:
        self.dir = Path(run_dir) / DIRNAME
        self.budget = int(max_mb * 2**20)
        self.full = False  # the budget stopped the record (no later step is written)
        self.used = 0

    def truncate_after(self, step: int) -> None:
        """Delete the step files after `step` (a resumed run redoes those steps) and any
        temporary file a kill left; count what remains against the budget."""
        self.used = 0
        if not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            found = _STEP_FILE.match(path.name)
            if path.name.startswith(".") or (found is not None and int(found.group(1)) > step):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            elif path.is_file():
                self.used += path.stat().st_size
        self.full = self.used >= self.budget

    def write(self, step: int, summary: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
        """Write step `step`'s file atomically; False (and nothing written, now or later)
        when it would take the directory past the budget."""
        if self.full:
            return False
        text = encode_step(step, summary, rows)
        size = len(text.encode("utf-8"))
        if self.used + size > self.budget:
            self.full = True
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(step_path(self.dir, step), text)
        self.used += size
        return True


# ---- reading (roll view) -------------------------------------------------------------------


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps with a record in `run_dir`, ascending."""
    directory = Path(run_dir) / DIRNAME
    if not directory.is_dir():
        return []
    steps = [_STEP_FILE.match(p.name) for p in directory.iterdir()]
    return sorted(int(m.group(1)) for m in steps if m is not None)


def read_summary(run_dir: Path, step: int) -> dict[str, Any]:
    """The first line of step `step`'s file: ``{"step", "summary"}``."""
    path = step_path(Path(run_dir) / DIRNAME, step)
    with open(path, encoding="utf-8") as f:
        return _parse(path, 1, f.readline())


def read_step(run_dir: Path, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Step `step`'s summary line and its rows."""
    path = step_path(Path(run_dir) / DIRNAME, step)
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        raise RunDirError(f"{path} is empty.", hint="Delete it; the step is then not shown.")
    head = _parse(path, 1, lines[0])
    return head, [_parse(path, n, line) for n, line in enumerate(lines[1:], 2) if line]


def _parse(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise RunDirError(
            f"{path} line {number} is not a rollout record ({err.msg}).",
            hint="The file was edited or damaged (roll writes whole files only): delete it.",
        ) from None
    if not isinstance(record, dict):
        raise RunDirError(f"{path} line {number} is not a JSON object.", hint="Delete the file.")
    return record
