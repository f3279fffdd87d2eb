"""No caller names a worker method by string: `cluster.method(...)` (dispatched and collected
as the method declares) or `cluster.at(rank).method(...)` (non-blocking, one rank) instead of
`cluster.submit(rank, "method", ...)`, so a renamed or undeclared method fails where it is
called, not inside a worker. Checked on the source of roll_core."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED: set[str] = set()  # every call site names a bound method (issue 27)


def method_strings(source: str) -> list[tuple[int, str]]:
    """(line, method name) of every ``x.submit(...)`` call that passes a method name as a
    string literal among its first two arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "submit"
        ):
            for arg in node.args[:2]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
    return found


def test_the_check_finds_a_method_named_by_string() -> None:
    assert method_strings('infer.submit(0, "generate", reqs)\nh.submit("ping")') == [
        (1, "generate"),
        (2, "ping"),
    ]
    assert method_strings("pool.submit(self._score, sample)\ninfer.at(0).generate(r)") == []


def test_no_worker_method_is_named_by_string() -> None:
    offenders = []
    for path in sorted((ROOT / "roll_core").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for line, name in method_strings(path.read_text(encoding="utf-8")):
            offenders.append(f"{rel}:{line} submit(..., {name!r})")
    assert not offenders, (
        "worker methods named by string; call cluster.at(rank).method(...) instead:\n"
        + "\n".join(offenders)
    )
