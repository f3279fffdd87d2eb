"""The bug planter: every operator, exact text edits, a fixed order."""

from __future__ import annotations

import ast

from roll_core.swe.mutate import mutants

SOURCE = '''"""A module."""


def clamp(x, lo=0, flag=True):
    """Docstring: never mutated (3 < 4)."""
    if x < lo:
        return lo
    return x + 1 if flag and not x == 7 else max(x, lo)
'''


def changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    la, lb = a.splitlines(), b.splitlines()
    if len(la) != len(lb):
        return [("<lines>", f"{len(la)} -> {len(lb)}")]
    return [(x, y) for x, y in zip(la, lb, strict=True) if x != y]


def test_each_operator_edits_only_its_text() -> None:
    found = mutants(SOURCE)
    got = {(m.op, c) for m in found for c in changed_lines(SOURCE, m.source)}
    line_if, line_ret = "    if x < lo:", "    return x + 1 if flag and not x == 7 else max(x, lo)"
    expected = {
        ("wrong_default", ("def clamp(x, lo=0, flag=True):", "def clamp(x, lo=1, flag=True):")),
        ("wrong_default", ("def clamp(x, lo=0, flag=True):", "def clamp(x, lo=0, flag=False):")),
        ("comparison", (line_if, "    if x <= lo:")),
        ("comparison", (line_ret, "    return x + 1 if flag and not x != 7 else max(x, lo)")),
        ("operator", (line_ret, "    return x - 1 if flag and not x == 7 else max(x, lo)")),
        ("boolean", (line_ret, "    return x + 1 if flag or not x == 7 else max(x, lo)")),
        ("boolean", (line_ret, "    return x + 1 if flag and x == 7 else max(x, lo)")),
        ("off_by_one", (line_ret, "    return x + 2 if flag and not x == 7 else max(x, lo)")),
        ("off_by_one", (line_ret, "    return x + 0 if flag and not x == 7 else max(x, lo)")),
        ("off_by_one", (line_ret, "    return x + 1 if flag and not x == 8 else max(x, lo)")),
        ("off_by_one", (line_ret, "    return x + 1 if flag and not x == 6 else max(x, lo)")),
        ("swapped_args", (line_ret, "    return x + 1 if flag and not x == 7 else max(lo, x)")),
        ("dropped_branch", ("<lines>", "8 -> 6")),
    }
    assert got == expected
    assert all(m.function == "clamp" for m in found)
    assert [m.site for m in found] == list(range(len(found)))
    for m in found:
        ast.parse(m.source)
    dropped = next(m for m in found if m.op == "dropped_branch")
    assert "if x < lo" not in dropped.source and "return lo" not in dropped.source


def test_a_lone_branch_leaves_pass_and_methods_are_named() -> None:
    source = "class A:\n    def f(self, x):\n        if x:\n            return 1\n"
    (m,) = [m for m in mutants(source) if m.op == "dropped_branch"]
    assert m.function == "A.f"
    assert m.source == "class A:\n    def f(self, x):\n        pass\n"


def test_the_order_is_stable() -> None:
    assert [m.source for m in mutants(SOURCE)] == [m.source for m in mutants(SOURCE)]
