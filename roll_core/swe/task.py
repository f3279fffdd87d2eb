"""SWE tasks: the type, the folder layout, SWE-bench-style JSONL, and their checks.

A task folder (what ``roll data swe`` writes, one per task, and what a user writes by hand)::

    <task_id>/
      task.json      {"problem_statement": str, "FAIL_TO_PASS": [test ids],
                      "PASS_TO_PASS": [test ids], "meta": {...} (optional)}
      repo/          the repository as the agent gets it (with the bug)
      hidden_tests/  files laid over repo/ at grading only (same relative paths)
      fix.patch      the reference fix: a unified diff that ``git apply`` takes in repo/

Test ids are pytest node ids relative to the repository (``tests/test_x.py::test_y``). A
folder of task folders (nested at any depth, e.g. ``train/`` and ``test/``) loads as a list.

SWE-bench-style JSONL, one task a line: ``instance_id``, ``problem_statement``,
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists, or JSON text of lists as SWE-bench writes
them), ``patch`` (the reference fix), ``test_patch`` (the diff that adds the hidden tests) and
``repo_path``: the repository on this machine, relative to the JSONL file's directory.

Loading checks the structure (a missing repository, hidden tests, field or fix is a
:class:`~roll_core.errors.DataError` naming the task); :func:`roll_core.swe.grading.
check_task` runs the tests to check the semantics (the hidden tests fail before the fix and
pass after it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.errors import DataError
from roll_core.sandbox.diff import diff_paths

__all__ = ["SweTask", "load_tasks", "write_task"]


@dataclass(frozen=True)
class SweTask:
    """One task: a repository with a bug, its issue, its tests and a reference fix."""

    task_id: str
    """Unique name (the folder name or the JSONL ``instance_id``)."""

    repo_dir: Path
    """The repository the agent starts from."""

    problem_statement: str
    """The issue: the symptom, not the fix."""

    fail_to_pass: tuple[str, ...]
    """Tests that fail on ``repo_dir`` and must pass after the fix."""

    pass_to_pass: tuple[str, ...]
    """Tests that pass before and must still pass after."""

    test_patch: str
    """A diff that adds the hidden tests to the repository (applied at grading only)."""

    patch: str
    """The reference fix (a diff ``git apply`` takes in the repository)."""

    split: str = "train"
    """``train`` or ``test`` (held out)."""

    meta: dict[str, Any] = field(default_factory=dict)
    """Generator facts (template, function, mutation operator) or the user's own."""


def _fail(task: str, what: str, hint: str) -> DataError:
    return DataError(f"SWE task {task!r}: {what}", hint=hint)


def _id_list(task: str, row: dict[str, Any], key: str, required: bool) -> tuple[str, ...]:
    value = row.get(key, None if required else [])
    if value is None:
        raise _fail(task, f"no {key} field", f"Add {key}: a list of pytest node ids.")
    if isinstance(value, str):  # SWE-bench stores these lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(task, f"{key} is not a list of test ids", "Write it as a JSON list.")
    if required and not value:
        raise _fail(task, f"{key} is empty", "A task needs at least one test that the fix fixes.")
    return tuple(value)


def _hidden_patch(task: str, repo: Path, hidden: Path) -> str:
    files = sorted(p for p in hidden.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise _fail(task, f"{hidden} holds no test file", "Put the hidden tests there.")
    parts = []
    for path in files:
        rel = path.relative_to(hidden).as_posix()
        old = repo / rel
        before = old.read_text(encoding="utf-8").splitlines(True) if old.is_file() else None
        parts.append(diff_paths(rel, before, path.read_text(encoding="utf-8").splitlines(True)))
    return "".join(parts)


def load_task_dir(path: Path, split: str = "train") -> SweTask:
    """One task folder (see the module docstring)."""
    name = path.name
    meta_path = path / "task.json"
    if not meta_path.is_file():
        raise _fail(name, f"no task.json in {path}", "See the task folder layout in docs/swe.md.")
    try:
        row = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise _fail(name, f"{meta_path} is not valid JSON ({err})", "Fix the file.") from None
    repo, hidden, fix = path / "repo", path / "hidden_tests", path / "fix.patch"
    if not repo.is_dir():
        raise _fail(name, f"no repository at {repo}", "Put the repository (with the bug) in repo/.")
    if not hidden.is_dir():
        raise _fail(
            name,
            f"no hidden tests at {hidden}",
            "Put the tests that check the fix in hidden_tests/.",
        )
    if not fix.is_file():
        raise _fail(name, f"no reference fix at {fix}", "Write the fix as a unified diff there.")
    statement = row.get("problem_statement")
    if not isinstance(statement, str) or not statement.strip():
        raise _fail(name, "no problem_statement in task.json", "Describe the bug's symptom.")
    return SweTask(
        task_id=name,
        repo_dir=repo,
        problem_statement=statement,
        fail_to_pass=_id_list(name, row, "FAIL_TO_PASS", True),
        pass_to_pass=_id_list(name, row, "PASS_TO_PASS", False),
        test_patch=_hidden_patch(name, repo, hidden),
        patch=fix.read_text(encoding="utf-8"),
        split=str(row.get("split", split)),
        meta=dict(row.get("meta", {})),
    )


def _load_jsonl(path: Path) -> list[SweTask]:
    tasks = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{n} is not valid JSON ({err})") from None
        name = str(row.get("instance_id") or f"{path.name}:{n}")
        for key in ("problem_statement", "patch", "test_patch", "repo_path"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise _fail(name, f"no {key} field ({path}:{n})", f"Add {key} to the line.")
        repo = (path.parent / row["repo_path"]).resolve()
        if not repo.is_dir():
            raise _fail(name, f"repo_path {repo} is not a directory", "Point it at a checkout.")
        tasks.append(
            SweTask(
                task_id=name,
                repo_dir=repo,
                problem_statement=row["problem_statement"],
                fail_to_pass=_id_list(name, row, "FAIL_TO_PASS", True),
                pass_to_pass=_id_list(name, row, "PASS_TO_PASS", False),
                test_patch=row["test_patch"],
                patch=row["patch"],
                split=str(row.get("split", "train")),
                meta={k: v for k, v in row.items() if k in ("repo", "base_commit", "version")},
            )
        )
    return tasks


def load_tasks(path: Path, split: str | None = None) -> list[SweTask]:
    """Tasks from a task folder, a folder of them, or a JSONL file; ``split`` keeps only
    that split. Sorted by task id; duplicate ids are an error."""
    path = Path(path)
    if path.is_file() and path.suffix == ".jsonl":
        tasks = _load_jsonl(path)
    elif (path / "task.json").is_file():
        tasks = [load_task_dir(path)]
    elif path.is_dir():
        for repo in sorted(path.rglob("repo")):
            if repo.is_dir() and not (repo.parent / "task.json").is_file():
                raise _fail(repo.parent.name, f"no task.json in {repo.parent}",
                            "See the task folder layout in docs/swe.md.")  # fmt: skip
        tasks = [load_task_dir(p.parent) for p in sorted(path.rglob("task.json"))]
        if not tasks:
            raise DataError(f"no SWE tasks under {path} (no task.json found)",
                            hint="See the task folder layout in docs/swe.md.")  # fmt: skip
    else:
        raise DataError(
            f"no SWE tasks at {path}",
            hint="Pass a task folder, a folder of them, or a .jsonl file (docs/swe.md).",
        )
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise _fail(task.task_id, "appears twice", "Give every task its own id.")
        seen.add(task.task_id)
    if split is not None:
        tasks = [t for t in tasks if t.split == split]
    return sorted(tasks, key=lambda t: t.task_id)


def write_task(
    out: Path,
    *,
    repo_files: dict[str, str],
    hidden_files: dict[str, str],
    fix: str,
    row: dict[str, Any],
) -> None:
    """Write one task folder (see the module docstring)."""
    for base, files in ((out / "repo", repo_files), (out / "hidden_tests", hidden_files)):
        for rel, text in files.items():
            target = base / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    (out / "fix.patch").write_text(fix, encoding="utf-8")
    (out / "task.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n", "utf-8")
