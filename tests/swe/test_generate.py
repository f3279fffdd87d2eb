"""`roll data swe`: deterministic, verified tasks; disjoint splits; the real CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roll_core.sandbox import LocalBackend
from roll_core.sandbox.local import namespaces_work
from roll_core.swe.generate import TEMPLATES, generate_swe_tasks
from roll_core.swe.grading import check_task
from roll_core.swe.repos_b import STATS
from roll_core.swe.task import load_tasks

pytestmark = pytest.mark.skipif(
    not namespaces_work(sys.executable, True, 65534)[0],
    reason="the local sandbox needs user namespaces",
)


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_generation_is_deterministic_verified_and_splits_share_no_function(tmp_path) -> None:
    backend = LocalBackend(max_concurrent=2)
    kw = dict(seed=5, count=4, held_out=0.5, backend=backend, templates=(STATS,))
    report = generate_swe_tasks(tmp_path / "a", **kw)
    generate_swe_tasks(tmp_path / "b", **kw)
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    assert report.train + report.test == 4 and report.train and report.test
    tasks = load_tasks(tmp_path / "a")
    assert len(tasks) == 4
    keys = {s: {(t.meta["module"], t.meta["function"]) for t in tasks if t.split == s}
            for s in ("train", "test")}  # fmt: skip
    assert not keys["train"] & keys["test"]
    for task in tasks:
        hidden = [t for t in task.fail_to_pass if "_issue.py::" in t]
        assert hidden and set(task.fail_to_pass).isdisjoint(task.pass_to_pass)
        assert "print(repr(" in task.problem_statement and "```python" in task.problem_statement
        removed = [ln[1:].strip() for ln in task.patch.splitlines() if ln.startswith("-    ")]
        assert not any(r and r in task.problem_statement for r in removed)  # not the fix
    check_task(tasks[0], backend=backend)  # fails before, the reference fix makes it pass


def test_there_are_enough_candidate_bugs_for_200_tasks() -> None:
    from roll_core.swe.mutate import mutants

    total = sum(len(mutants(t.files[m])) for t in TEMPLATES for m in t.modules())
    assert len(TEMPLATES) == 7 and total >= 400  # about 80% qualify (docs/swe.md)


@pytest.mark.slow
def test_roll_data_swe_cli(roll, tmp_path: Path) -> None:
    out = tmp_path / "swe"
    result = roll("data", "swe", str(out), "--count", "2", "--seed", "5", "--repos", "matrix")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SWE tasks" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["train"] + manifest["test"] == 2 and len(load_tasks(out)) == 2
    assert all(t.meta["template"] == "matrix" for t in load_tasks(out))
    again = roll("data", "swe", str(out), "--count", "2")
    assert again.returncode == 2 and "is not empty" in again.stdout + again.stderr
    bad = roll("data", "swe", str(tmp_path / "x"), "--count", "0")
    assert bad.returncode == 2 and "--count" in bad.stdout + bad.stderr
    typo = roll("data", "swe", str(tmp_path / "y"), "--repos", "matrx")
    assert typo.returncode == 2 and "unknown SWE repository 'matrx'" in typo.stdout + typo.stderr
    assert "Traceback" not in typo.stdout + typo.stderr
