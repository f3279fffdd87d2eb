"""What the sandbox shows a program of its interpreter, from a virtualenv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core.rewards.sandbox import Sandbox, TestCase, _interpreter, namespaces_available


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv of this interpreter's base installation (no pip: fast)."""
    path = tmp_path_factory.mktemp("venv") / "v"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(path)], check=True)
    path.parent.chmod(0o755)  # as root the program's uid must reach it (site_packages)
    return path


def test_a_venv_runs_programs_on_its_base_interpreter(venv: Path) -> None:
    program, binds, _ = _interpreter(str(venv / "bin" / "python"), False)
    assert program == os.path.realpath(venv / "bin" / "python")  # the base's binary
    assert os.path.realpath(sys.base_prefix) in binds
    assert str(venv) not in binds  # the venv itself is not shown without site_packages


def test_with_site_packages_the_venv_is_shown_and_executed(venv: Path) -> None:
    program, binds, _ = _interpreter(str(venv / "bin" / "python"), True)
    assert program == str(venv / "bin" / "python")  # so that site finds pyvenv.cfg
    assert os.path.realpath(venv) in binds


@pytest.mark.parametrize("site_packages", [False, True])
@pytest.mark.parametrize("mode", ["namespaces", "rlimits"])
def test_a_correct_program_passes_from_a_venv(venv: Path, mode: str, site_packages: bool) -> None:
    if mode == "namespaces" and not namespaces_available()[0]:
        pytest.skip(f"namespaces mode unavailable here: {namespaces_available()[1]}")
    sandbox = Sandbox(mode=mode, python=str(venv / "bin" / "python"), site_packages=site_packages)
    code = "import sys\nprint(int(input()) * 2, sys.prefix != sys.base_prefix)\n"
    result = sandbox.run(code, [TestCase("stdio", "21\n", f"42 {site_packages}\n")], [10.0])
    assert result.sandbox_error is None, result.sandbox_error
    assert result.all_passed, result.cases
