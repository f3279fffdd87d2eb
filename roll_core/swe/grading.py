"""Grading a diff against a task, and checking a task, in fresh sandboxes.

:func:`grade` copies the task's repository into a **fresh** sandbox (the agent's own
workspace is never graded), applies the agent's diff with ``git apply`` (``patch -p1`` where
git is missing), applies the task's hidden tests on top, and runs the fail-to-pass and
pass-to-pass tests with pytest there.

* Score: 1.0 when every fail-to-pass test passes and every pass-to-pass test still passes,
  else 0.0. With ``partial_credit``: (fail-to-pass passed / their number) x (pass-to-pass
  passed / their number): fixing half the failing tests and breaking nothing is 0.5, an
  empty diff 0.
* A diff that does not apply scores 0 (``applied`` False).
* The parts of the diff that touch the tests are dropped before it is applied (listed in
  ``dropped``): the files of the task's test ids and hidden tests, any ``conftest.py``,
  pytest's configuration files (``pytest.ini``, ``tox.ini``, ``setup.cfg``,
  ``pyproject.toml``), ``sitecustomize.py``/``usercustomize.py`` and ``*.pth`` files. The
  agent's code still runs inside pytest's process when the tests import it; the grade is
  the verdict pytest reports there (see docs/swe.md for what that does not rule out).
"""

from __future__ import annotations

import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from roll_core.errors import DataError
from roll_core.sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from roll_core.sandbox.diff import split_diff
from roll_core.swe.task import SweTask

__all__ = ["GradeResult", "check_task", "check_tasks", "grade", "run_tests"]

PROTECTED_NAMES = frozenset(
    {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
     "usercustomize.py"}
)  # fmt: skip
PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -p no:cacheprovider -q -rA --tb=no --continue-on-collection-errors"
_OUTCOMES = {"PASSED": True, "XFAIL": False, "XPASS": False, "FAILED": False, "ERROR": False}


@dataclass(frozen=True)
class GradeResult:
    """The verdict on one diff."""

    score: float
    """1.0 resolved, 0.0 not (a fraction with partial credit)."""

    resolved: bool
    """Every fail-to-pass and pass-to-pass test passed."""

    applied: bool
    """The diff applied (an empty diff applies)."""

    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    """Test id -> passed, for the fail-to-pass tests."""

    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    """Test id -> passed, for the pass-to-pass tests."""

    dropped: tuple[str, ...] = ()
    """Paths whose changes were dropped (tests and test configuration)."""

    error: str | None = None
    """Why the diff did not apply or the tests did not run."""

    seconds: float = 0.0
    """Wall time: sandbox creation, apply, tests."""


def protected(path: str, task: SweTask) -> bool:
    """Whether the agent's diff may not change ``path`` (see the module docstring)."""
    name = PurePosixPath(path).name
    if name in PROTECTED_NAMES or name.endswith(".pth"):
        return True
    tests = {t.split("::", 1)[0] for t in (*task.fail_to_pass, *task.pass_to_pass)}
    tests |= {p for p, _ in split_diff(task.test_patch)}
    return path in tests


def filter_diff(diff: str, task: SweTask) -> tuple[str, tuple[str, ...]]:
    """``diff`` without its sections on protected paths, and those paths."""
    kept, dropped = [], []
    for path, section in split_diff(diff):
        if protected(path, task):
            dropped.append(path)
        else:
            kept.append(section)
    return "".join(kept), tuple(dropped)


def apply_patch(box: Sandbox, diff: str, timeout: float = 60.0) -> str | None:
    """Apply ``diff`` in the sandbox's workspace; None, or why it did not apply."""
    if not diff.strip():
        return None
    tool = "git apply --whitespace=nowarn -" if shutil.which("git") else "patch -p1 --batch"
    result = box.exec(tool, timeout, stdin=diff)
    if result.ok:
        return None
    return (result.output().strip() or f"exit code {result.exit_code}")[-500:]


def pytest_command(test_ids: list[str]) -> str:
    """The shell command that runs ``test_ids``. Plugins are not auto-loaded
    (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``: 1 s instead of 6 s in roll's own environment); a
    repository whose tests need one loads it itself (``pytest_plugins`` in its own
    ``conftest.py``, which grading keeps)."""
    return PYTEST + " " + " ".join(shlex.quote(t) for t in test_ids)


def parse_pytest(stdout: str, test_ids: list[str], timed_out: bool) -> dict[str, bool]:
    """Test id -> passed, from pytest's ``-rA`` summary (ids it did not report, e.g. in a
    file that no longer imports, count as failed; so does everything after a timeout)."""
    seen: dict[str, bool] = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in _OUTCOMES:
            seen[rest.split(" - ", 1)[0].strip()] = _OUTCOMES[word]
    return {t: seen.get(t, False) and not timed_out for t in test_ids}


def run_tests(box: Sandbox, test_ids: list[str], timeout: float) -> tuple[dict[str, bool], str]:
    """Run pytest on ``test_ids`` in the sandbox: id -> passed, and the output's tail."""
    if not test_ids:
        return {}, ""
    result = box.exec(pytest_command(test_ids), timeout)
    return parse_pytest(result.stdout, test_ids, result.timed_out), result.output()[-2000:]


def _score(f2p: dict[str, bool], p2p: dict[str, bool], partial: bool) -> float:
    resolved = all(f2p.values()) and all(p2p.values()) and bool(f2p)
    if not partial:
        return 1.0 if resolved else 0.0
    f = sum(f2p.values()) / len(f2p) if f2p else 0.0
    p = sum(p2p.values()) / len(p2p) if p2p else 1.0
    return f * p


def grade(
    task: SweTask,
    diff: str,
    *,
    backend: SandboxBackend,
    spec: SandboxSpec | None = None,
    partial_credit: bool = False,
    timeout: float = 300.0,
) -> GradeResult:
    """Grade ``diff`` on ``task`` in a fresh sandbox (see the module docstring)."""
    start = time.perf_counter()
    kept, dropped = filter_diff(diff, task)
    box = backend.create(task.repo_dir, spec or SandboxSpec())
    try:
        error = apply_patch(box, kept)
        if error is not None:
            return GradeResult(0.0, False, False, dropped=dropped, error=f"diff: {error}",
                               seconds=time.perf_counter() - start)  # fmt: skip
        hidden_error = apply_patch(box, task.test_patch)
        if hidden_error is not None:  # the agent's change conflicts with the hidden tests
            return GradeResult(0.0, False, True, dropped=dropped, error=f"tests: {hidden_error}",
                               seconds=time.perf_counter() - start)  # fmt: skip
        ids = list(dict.fromkeys([*task.fail_to_pass, *task.pass_to_pass]))
        verdict, _ = run_tests(box, ids, timeout)
    finally:
        box.close()
    f2p = {t: verdict[t] for t in task.fail_to_pass}
    p2p = {t: verdict[t] for t in task.pass_to_pass}
    resolved = bool(f2p) and all(f2p.values()) and all(p2p.values())
    return GradeResult(
        score=_score(f2p, p2p, partial_credit),
        resolved=resolved,
        applied=True,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        dropped=dropped,
        seconds=time.perf_counter() - start,
    )


def check_task(task: SweTask, *, backend: SandboxBackend, spec: SandboxSpec | None = None) -> None:
    """Run the task's tests before and after its reference fix; a DataError naming the task
    when a fail-to-pass test already passes before the fix, a pass-to-pass test fails before
    it, or the fix does not make every test pass."""
    before = grade(task, "", backend=backend, spec=spec)
    if before.error:
        raise DataError(
            f"SWE task {task.task_id!r}: the hidden tests do not apply: {before.error}",
            hint="Check the task's hidden tests (test_patch) against its repository.",
        )
    passing = sorted(t for t, ok in before.fail_to_pass.items() if ok)
    if passing:
        raise DataError(
            f"SWE task {task.task_id!r}: fail-to-pass tests already pass before the fix: "
            f"{', '.join(passing)}",
            hint="A fail-to-pass test must fail on the repository as given; fix the task.",
        )
    broken = sorted(t for t, ok in before.pass_to_pass.items() if not ok)
    if broken:
        raise DataError(
            f"SWE task {task.task_id!r}: pass-to-pass tests fail before the fix: "
            f"{', '.join(broken)}",
            hint="List only tests that pass on the repository as given under PASS_TO_PASS.",
        )
    after = grade(task, task.patch, backend=backend, spec=spec)
    if not after.resolved:
        why = after.error or ", ".join(
            t for t, ok in {**after.fail_to_pass, **after.pass_to_pass}.items() if not ok
        )
        raise DataError(
            f"SWE task {task.task_id!r}: the reference fix does not make the tests pass ({why})",
            hint="Check fix.patch / patch against the repository and the hidden tests.",
        )


def check_tasks(
    tasks: list[SweTask], *, backend: SandboxBackend, spec: SandboxSpec | None = None
) -> list[DataError]:
    """:func:`check_task` on every task (as many at once as the backend has slots); the
    errors, in task order (empty: every task is sound)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(task: SweTask) -> DataError | None:
        try:
            check_task(task, backend=backend, spec=spec)
        except DataError as err:
            return err
        return None

    workers = max(1, int(getattr(backend, "max_concurrent", 2)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [err for err in pool.map(one, tasks) if err is not None]
