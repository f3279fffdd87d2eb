"""Planting one bug in one function with :mod:`ast`, touching only the mutated text.

:func:`mutants` lists every mutation of every top-level function and method of a module, in
a fixed order. A mutation replaces the source text of one node (an expression, an operator's
comparison, a default value) or deletes one ``if`` statement, so the rest of the file stays
byte-identical and the reference fix (the mutant back to the original) is a one-hunk diff.

Operators (``Mutant.op``):

``comparison``  ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``in`` <-> ``not in``
``operator``    ``+`` <-> ``-``, ``*`` -> ``+``, ``//`` <-> ``/``, ``%`` -> ``//``
``off_by_one``  an integer constant n in an expression -> n + 1 and n - 1
``swapped_args`` the first two positional arguments of a call swapped
``dropped_branch`` an ``if`` without ``else`` removed (``pass`` where it was alone)
``wrong_default`` a parameter's constant default changed (n -> n + 1, True <-> False)
``boolean``     ``and`` <-> ``or``; ``not x`` -> ``x``
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Mutant", "mutants"]

_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BIN: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.FloorDiv: ast.Div,
    ast.Div: ast.FloorDiv,
    ast.Mod: ast.FloorDiv,
}


@dataclass(frozen=True)
class Mutant:
    """One planted bug: the module's whole new text and where it is."""

    function: str
    """``Class.method`` or ``function``: the function holding the bug."""

    op: str
    """The operator (see the module docstring)."""

    site: int
    """Index of this mutation among the function's mutations (stable for a source)."""

    source: str
    """The module's text with the bug."""

    line: int
    """1-based line of the change."""


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line.encode("utf-8"))
        starts.append(total)
    return starts


def _replace(source: str, node: ast.AST, text: str) -> str:
    """``source`` with ``node``'s exact text replaced by ``text`` (positions are in bytes)."""
    starts = _offsets(source)
    data = source.encode("utf-8")
    a = starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
    b = starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
    return (data[:a] + text.encode("utf-8") + data[b:]).decode("utf-8")


def _delete_statement(source: str, stmt: ast.stmt, alone: bool) -> str:
    lines = source.splitlines(keepends=True)
    first, last = stmt.lineno - 1, stmt.end_lineno or stmt.lineno
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
    keep = [indent + "pass\n"] if alone else []
    return "".join(lines[:first] + keep + lines[last:])


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _in_docstring(fn: ast.FunctionDef, node: ast.AST) -> bool:
    first = fn.body[0]
    return (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and node is first.value
    )


def _edits(source: str, fn: ast.FunctionDef) -> Iterator[tuple[str, str, int]]:
    """(op, new module text, line) for every mutation inside ``fn``."""
    for default in [*fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None)]:
        if isinstance(default, ast.Constant) and isinstance(default.value, int | float | None):
            value = default.value
            new = not value if isinstance(value, bool) else 0 if value is None else value + 1
            yield "wrong_default", _replace(source, default, repr(new)), default.lineno
    for node in ast.walk(ast.Module(body=fn.body, type_ignores=[])):
        if _in_docstring(fn, node):
            continue
        yield from _node_edits(source, node)
        if isinstance(node, ast.If | ast.For | ast.While | ast.FunctionDef | ast.With):
            orelse: list[ast.stmt] = getattr(node, "orelse", [])
            blocks = [node.body] + ([orelse] if orelse else [])
            for block in blocks:
                for stmt in block:
                    if isinstance(stmt, ast.If) and not stmt.orelse:
                        text = _delete_statement(source, stmt, alone=len(block) == 1)
                        yield "dropped_branch", text, stmt.lineno
    for stmt in fn.body:
        if isinstance(stmt, ast.If) and not stmt.orelse:
            yield "dropped_branch", _delete_statement(source, stmt, len(fn.body) == 1), stmt.lineno


def _node_edits(source: str, node: ast.AST) -> Iterator[tuple[str, str, int]]:
    line = getattr(node, "lineno", 0)
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP:
                ops = list(node.ops)
                ops[i] = _CMP[type(op)]()
                new = ast.Compare(left=node.left, ops=ops, comparators=node.comparators)
                yield "comparison", _replace(source, node, ast.unparse(new)), line
    elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        new_bin = ast.BinOp(left=node.left, op=_BIN[type(node.op)](), right=node.right)
        yield "operator", _replace(source, node, ast.unparse(new_bin)), line
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolean", _replace(source, node, ast.unparse(ast.BoolOp(other, node.values))), line
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = ast.unparse(node.operand)
        if isinstance(node.operand, ast.BoolOp | ast.IfExp | ast.Lambda | ast.NamedExpr):
            inner = f"({inner})"
        yield "boolean", _replace(source, node, inner), line
    elif (
        isinstance(node, ast.Constant)
        and type(node.value) is int
        and getattr(node, "col_offset", -1) >= 0
    ):
        for delta in (1, -1):
            if node.value + delta >= 0:
                yield "off_by_one", _replace(source, node, repr(node.value + delta)), line
    elif isinstance(node, ast.Call) and len(node.args) >= 2:
        a, b = node.args[0], node.args[1]
        if not isinstance(a, ast.Starred) and not isinstance(b, ast.Starred):
            sa, sb = ast.get_source_segment(source, a), ast.get_source_segment(source, b)
            if sa and sb and sa != sb:
                swapped = _replace(_replace(source, b, sa), a, sb)  # later node first
                yield "swapped_args", swapped, line


def mutants(source: str) -> list[Mutant]:
    """Every mutation of every function of the module ``source`` that still parses and
    differs from it, in a fixed order."""
    tree = ast.parse(source)
    found: list[Mutant] = []
    seen: set[str] = set()
    for name, fn in _functions(tree):
        site = 0
        for op, text, line in _edits(source, fn):
            if text == source or text in seen:
                continue
            try:
                ast.parse(text)
            except SyntaxError:
                continue
            seen.add(text)
            found.append(Mutant(name, op, site, text, line))
            site += 1
    return found
