"""Every third-party package roll's code imports is declared in pyproject.toml, as a
dependency or in an extra. A package that is only there because something else pulled it into
the dev install works in every test and fails for a user who installs roll alone
(`cloudpickle`, imported by the worker processes, was such a package until session 22)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        names |= {_name(r) for r in extra}
    return names


def imported_modules() -> dict[str, str]:
    """Top-level module name -> the first file importing it, over roll_core and roll_cli."""
    seen: dict[str, str] = {}
    for path in sorted([*ROOT.glob("roll_core/**/*.py"), *ROOT.glob("roll_cli/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                seen.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return seen


def test_every_imported_package_is_declared() -> None:
    by_module = importlib.metadata.packages_distributions()
    ours = declared()
    undeclared = []
    for module, where in imported_modules().items():
        if module in sys.stdlib_module_names or module.startswith("roll_"):
            continue
        dists = {d.lower().replace("_", "-") for d in by_module.get(module, [])}
        if not dists:
            continue  # not installed here: an optional import guarded in the code
        if not dists & ours:
            undeclared.append(f"{module} ({'/'.join(sorted(dists))}, imported in {where})")
    assert not undeclared, "imported but not declared in pyproject.toml: " + ", ".join(undeclared)
