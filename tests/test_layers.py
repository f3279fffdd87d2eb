"""Imports only go down (ARCHITECTURE.md "The layers"): each package below may import only
from packages under it, checked on the source (every `import` / `from ... import`, lazy ones
inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIGHER = {
    # package: the packages above it, which it must not import
    "engine": ("roll_cli", "roll_core.pipelines", "roll_core.rollout", "roll_core.workers"),
    "backends": (
        "roll_cli",
        "roll_core.pipelines",
        "roll_core.rollout",
        "roll_core.workers",
        "roll_core.engine",
    ),
}
for pure in ("algorithms", "rewards", "envs", "data", "swe"):
    HIGHER[pure] = (*HIGHER["backends"], "ray")
# swe/ (SWE tasks and grading) sits under envs/ and beside data/, on sandbox/ only: no torch.
HIGHER["swe"] += ("roll_core.envs", "roll_core.rewards", "roll_core.data", "roll_core.models",
                  "torch")  # fmt: skip
# rollout/ produces batches for the pipelines and calls workers through clusters: it never
# reaches up into the driver loops or the CLI. workers/ hold role logic and know nothing about
# Ray, the rollout producers or the pipelines that call them.
# sandbox/ is the lowest layer the SWE tasks, the envs and the code reward build on: it imports
# only the standard library and roll_core.errors.
HIGHER["sandbox"] = tuple(
    f"roll_core.{p.name}"
    for p in sorted((ROOT / "roll_core").iterdir())
    if p.is_dir() and p.name not in ("sandbox", "__pycache__")
) + ("roll_cli", "ray", "torch")
HIGHER["rollout"] = ("roll_cli", "roll_core.pipelines", "roll_core.evaluation")
HIGHER["workers"] = (*HIGHER["rollout"], "roll_core.rollout", "ray")
# serve/ (`roll serve`, the Tinker API) sits at the level of the pipelines: it uses engines,
# backends, workers and models; nothing below imports it, and it calls no driver loop.
for below in list(HIGHER):
    HIGHER[below] = (*HIGHER[below], "roll_core.serve")
HIGHER["serve"] = ("roll_cli", "roll_core.pipelines", "roll_core.evaluation")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(HIGHER))
def test_no_upward_imports(package: str) -> None:
    bad = []
    for path in sorted((ROOT / "roll_core" / package).rglob("*.py")):
        for line, module in _imports(path):
            if any(module == h or module.startswith(h + ".") for h in HIGHER[package]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)
