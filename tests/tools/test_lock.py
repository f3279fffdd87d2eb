"""lock-cpu.txt is fresh against pyproject.toml, and the staleness check can fail."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lock_module():
    spec = importlib.util.spec_from_file_location("roll_tools_lock", ROOT / "tools" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _lock_module()


def test_the_committed_lock_is_fresh() -> None:
    problems = lock.check(ROOT)
    assert problems == [], "\n".join(problems)


def test_every_pin_is_exact_and_sorted() -> None:
    lines = [
        ln for ln in (ROOT / lock.LOCK).read_text().splitlines() if ln and not ln.startswith("#")
    ]
    names = [ln.partition("==")[0] for ln in lines]
    assert names == sorted(names)
    assert all("==" in ln and "+" not in ln for ln in lines)
    _, pins = lock.read_lock(ROOT / lock.LOCK)
    assert pins["torch"] == "2.13.0"  # the version constraints-cpu.txt names
    assert "matplotlib" in pins and "roll" not in pins


def test_the_backend_extras_are_pinned_in_the_lock() -> None:
    """`pip install 'roll[megatron]'` and `roll[deepspeed]` (the train backends' extras) accept
    the release the lock pins, the one the tests run."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    _, pins = lock.read_lock(ROOT / lock.LOCK)
    for extra in ("megatron", "deepspeed"):
        for spec in extras["optional-dependencies"][extra]:
            req = Requirement(spec)
            pinned = pins[lock.normalize(req.name)]
            assert req.specifier.contains(pinned), (extra, spec, pinned)


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    for name in ("pyproject.toml", lock.CONSTRAINTS, lock.LOCK):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_a_new_dependency_makes_the_lock_stale(project_copy: Path) -> None:
    pyproject = project_copy / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace('"requests>=2.31",', '"requests>=2.31",\n  "pendulum>=3",'))
    problems = lock.check(project_copy)
    assert any("inputs-sha256 differs" in p for p in problems)
    assert any("pendulum" in p for p in problems)


def test_a_changed_bound_or_constraint_makes_it_stale(project_copy: Path) -> None:
    pyproject = project_copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"numpy>=1.26"', '"numpy>=2.0"'))
    assert lock.check(project_copy)
    shutil.copy(ROOT / "pyproject.toml", pyproject)
    assert lock.check(project_copy) == []
    (project_copy / lock.CONSTRAINTS).write_text("torch==2.14.0\n")
    assert lock.check(project_copy)


def test_comments_and_formatting_do_not_count(project_copy: Path) -> None:
    pyproject = project_copy / "pyproject.toml"
    pyproject.write_text("# a comment\n" + pyproject.read_text())
    constraints = project_copy / lock.CONSTRAINTS
    constraints.write_text("# another comment\n\n" + constraints.read_text())
    assert lock.check(project_copy) == []


def test_render_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    pins = {"Zeta_Pkg": "1.0", "alpha": "2.0", "PyYAML": "6.0.3"}
    text = lock.render(pins, "abc")
    assert text == lock.render(dict(reversed(list(pins.items()))), "abc")
    assert text.splitlines()[-3:] == ["alpha==2.0", "pyyaml==6.0.3", "zeta-pkg==1.0"]
    (tmp_path / "lock.txt").write_text(text)
    assert lock.read_lock(tmp_path / "lock.txt") == (
        "abc",
        {"alpha": "2.0", "pyyaml": "6.0.3", "zeta-pkg": "1.0"},
    )
