"""SWE tasks: loading (folders, JSONL), bad input, grading in fresh sandboxes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from roll_core.errors import DataError
from roll_core.sandbox import LocalBackend, SandboxSpec
from roll_core.sandbox.local import namespaces_work
from roll_core.swe.grading import check_task, grade
from roll_core.swe.task import load_tasks

pytestmark = pytest.mark.skipif(
    not namespaces_work(__import__("sys").executable, True, 65534)[0],
    reason="the local sandbox needs user namespaces",
)
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIX = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,5 +1,5 @@\n"
    " def add(a, b):\n-    return a - b\n+    return a + b\n \n \n def mul(a, b):\n"
)
HIDDEN = (
    "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_add_ones():\n    assert add(1, 1) == 2\n"
)
F2P = ["tests/test_add.py::test_add", "tests/test_add.py::test_add_ones"]
P2P = ["tests/test_calc.py::test_mul"]


def make_task(root: Path, name: str = "calc-1", **row) -> Path:
    task = root / name
    (task / "repo" / "tests").mkdir(parents=True)
    (task / "repo" / "calc.py").write_text(BUGGY)
    (task / "repo" / "tests" / "test_calc.py").write_text(
        "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
    )
    (task / "hidden_tests" / "tests").mkdir(parents=True)
    (task / "hidden_tests" / "tests" / "test_add.py").write_text(HIDDEN)
    (task / "fix.patch").write_text(FIX)
    data = {"problem_statement": "add(2, 3) gives -1", "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P}
    (task / "task.json").write_text(json.dumps({**data, **row}))
    return task


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    return LocalBackend(max_concurrent=2)


def test_a_task_folder_loads(tmp_path: Path) -> None:
    (task,) = load_tasks(make_task(tmp_path))
    assert task.task_id == "calc-1" and task.fail_to_pass == tuple(F2P)
    assert "new file mode" in task.test_patch and "+++ b/tests/test_add.py" in task.test_patch


def test_grading_scores_the_fix_the_empty_diff_and_a_test_edit(tmp_path: Path, backend) -> None:
    (task,) = load_tasks(make_task(tmp_path))
    good = grade(task, task.patch, backend=backend)
    assert good.score == 1.0 and good.resolved and good.applied
    assert good.pass_to_pass == {P2P[0]: True}
    empty = grade(task, "", backend=backend)
    assert empty.score == 0.0 and empty.fail_to_pass == dict.fromkeys(F2P, False)
    # editing the tests (deleting the asserts, a conftest) is dropped before grading
    cheat = (
        "diff --git a/tests/test_calc.py b/tests/test_calc.py\n--- a/tests/test_calc.py\n"
        "+++ b/tests/test_calc.py\n@@ -5 +5 @@\n-    assert mul(2, 3) == 6\n+    pass\n"
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/conftest.py\n@@ -0,0 +1 @@\n+import sys\n"
    )
    cheated = grade(task, cheat, backend=backend)
    assert cheated.dropped == ("tests/test_calc.py", "conftest.py") and cheated.score == 0.0
    broken = grade(
        task, "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", backend=backend
    )
    assert not broken.applied and broken.score == 0.0 and "diff:" in (broken.error or "")


def test_partial_credit_is_the_share_of_fixed_tests(tmp_path: Path, backend) -> None:
    (task,) = load_tasks(make_task(tmp_path))
    half = task.patch.replace("+    return a + b", "+    return a + b if a == 2 else a - b")
    assert grade(task, half, backend=backend).score == 0.0
    assert grade(task, half, backend=backend, partial_credit=True).score == 0.5


def test_check_task_accepts_a_good_task_and_names_a_bad_one(tmp_path: Path, backend) -> None:
    (task,) = load_tasks(make_task(tmp_path))
    check_task(task, backend=backend)
    (passing,) = load_tasks(make_task(tmp_path, "calc-2", FAIL_TO_PASS=P2P, PASS_TO_PASS=[]))
    with pytest.raises(DataError, match=r"'calc-2'.*already pass before the fix"):
        check_task(passing, backend=backend)
    bad = make_task(tmp_path, "calc-3")
    (bad / "fix.patch").write_text(FIX.replace("+    return a + b", "+    return a * b"))
    with pytest.raises(DataError, match=r"'calc-3'.*reference fix does not make"):
        check_task(load_tasks(bad)[0], backend=backend)


@pytest.mark.parametrize("missing", ["repo", "hidden_tests", "fix.patch", "task.json"])
def test_a_task_folder_missing_a_part_is_named(tmp_path: Path, missing: str) -> None:
    task = make_task(tmp_path / "tasks")
    target = task / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    what = {"repo": "repository", "hidden_tests": "hidden tests", "fix.patch": "reference fix"}
    with pytest.raises(DataError, match=f"'calc-1': no {what.get(missing, missing)}"):
        load_tasks(task if missing != "task.json" else tmp_path / "tasks")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no SWE tasks under"):
        load_tasks(tmp_path / "empty")


def test_swe_bench_style_jsonl_loads(tmp_path: Path) -> None:
    (task,) = load_tasks(make_task(tmp_path))
    row = {
        "instance_id": "calc__calc-1",
        "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": json.dumps(F2P),  # SWE-bench writes these lists as JSON text
        "PASS_TO_PASS": P2P,
        "patch": task.patch,
        "test_patch": task.test_patch,
        "repo_path": "calc-1/repo",
    }
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    (loaded,) = load_tasks(tmp_path / "tasks.jsonl")
    assert loaded.fail_to_pass == tuple(F2P) and loaded.repo_dir == task.repo_dir.resolve()
    row.pop("test_patch")
    (tmp_path / "bad.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"'calc__calc-1': no test_patch"):
        load_tasks(tmp_path / "bad.jsonl")


def test_a_workspace_diff_applies_to_a_fresh_copy(tmp_path: Path, backend) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("one\ntwo\nthree\n")
    (src / "pkg" / "gone.py").write_text("bye\n")
    (src / "tail.txt").write_text("no newline")
    spec = SandboxSpec()
    with backend.create(src, spec) as box:
        box.exec(
            "sed -i 's/two/TWO/' pkg/a.py && rm pkg/gone.py && printf 'x\\ny' > new.txt "
            "&& printf 'changed' > tail.txt && touch empty.txt",
            timeout=20,
        )
        diff = box.diff()
    with backend.create(src, spec) as fresh:
        applied = fresh.exec("git apply -", timeout=20, stdin=diff)
        assert applied.ok, applied.output()
        assert fresh.read_file("pkg/a.py") == "one\nTWO\nthree\n"
        assert fresh.read_file("new.txt") == "x\ny" and fresh.read_file("tail.txt") == "changed"
        assert fresh.read_file("empty.txt") == ""
        assert not (fresh.workspace / "pkg" / "gone.py").exists()
        assert fresh.diff() == diff


@pytest.mark.slow
def test_roll_data_swe_check_names_the_bad_task(roll, tmp_path: Path) -> None:
    make_task(tmp_path / "tasks")
    ok = roll("data", "swe-check", str(tmp_path / "tasks"))
    assert ok.returncode == 0 and "1 SWE tasks" in ok.stdout and "are sound" in ok.stdout
    bad = make_task(tmp_path / "tasks", "calc-2")
    (bad / "fix.patch").write_text(FIX.replace("+    return a + b", "+    return a * b"))
    result = roll("data", "swe-check", str(tmp_path / "tasks"))
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "1 of 2 SWE tasks" in out and "'calc-2'" in out
    assert "reference fix does not make" in out and "Traceback" not in out
