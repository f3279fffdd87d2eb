"""No function over 80 lines in roll_core/ and roll_cli/ (STYLE.md: "a function that needs a
scroll is two"). Counted on the source with `ast`, from the `def` line to the last line of the
body (decorators not counted, docstring and signature counted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def long_functions(root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function of roll_core/ and roll_cli/ over
    ``limit`` lines."""
    found = []
    for package in ("roll_core", "roll_cli"):
        for path in sorted((root / package).rglob("*.py")):
            tree = _parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > limit:
                        where = f"{path.relative_to(root)}:{node.lineno}"
                        found.append(f"{where} {node.name} ({length} lines)")
    return found


def test_no_function_over_80_lines() -> None:
    found = long_functions()
    assert not found, (
        f"functions over {MAX_LINES} lines (split each into well-named helpers):\n"
        + "\n".join(found)
    )


def _parse(source: str) -> ast.AST:
    """ast.parse, once more on CPython 3.11's spurious "AST constructor recursion depth
    mismatch" SystemError (a CPython bug, gh-106905, seen once in CI in a pytest-xdist worker
    that had run other tests): the same source parses the second time."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)
