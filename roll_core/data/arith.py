"""The tiny arithmetic data set that the tiny recipes train and evaluate on.

Every row is one problem with a fixed wording and a bare answer::

    {"prompt": "What is 23 + 45?", "response": "68", "answer": "68", "domain": "math"}

* Operands are integers in ``[0, max_operand]``.
* Subtraction puts the larger operand first, so every answer is ``>= 0`` and is only digits
  (``"What is 45 - 23?"`` -> ``"22"``): a tiny model never has to learn a minus sign.
* Rows are drawn independently (a problem can repeat inside a split); ``write_arith_dataset``
  keeps the test problems unique and never lets a test problem ``(a, op, b)`` into train.

Randomness comes only from :meth:`random.Random.random`, the one stream Python promises to
keep stable across versions, so the same seed gives byte-identical files everywhere.
``data/tiny-arith/`` is ``write_arith_dataset("data/tiny-arith")`` (seed 0).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

Problem = tuple[int, str, int]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
PROMPT_TEMPLATE = "What is {a} {op} {b}?"


def make_arith_rows(
    n: int, *, seed: int, ops: Sequence[str] = ("+", "-"), max_operand: int = 99
) -> list[dict[str, str]]:
    """``n`` rows drawn independently with ``random.Random(seed)`` (see the module docstring)."""
    problems = _problems(random.Random(seed), ops, max_operand)
    return [arith_row(next(problems)) for _ in range(n)]


def arith_row(problem: Problem) -> dict[str, str]:
    """The row of one problem ``(a, op, b)``."""
    a, op, b = problem
    answer = str(_OPS[op](a, b))
    return {
        "prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b),
        "response": answer,
        "answer": answer,
        "domain": "math",
    }


def write_arith_dataset(
    out_dir: str | Path,
    *,
    n_train: int = 20000,
    n_test: int = 500,
    seed: int = 0,
    ops: Sequence[str] = ("+", "-"),
    max_operand: int = 99,
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir``; return their paths by split.

    Test problems are unique and drawn from ``random.Random(seed)``; train problems come from
    ``random.Random(seed + 1)`` with every test problem skipped, so the splits never overlap.
    """
    n_problems = _count_problems(ops, max_operand)
    if n_test >= n_problems:
        raise ValueError(
            f"n_test={n_test} leaves no problem for train: there are only {n_problems} "
            f"problems with ops {tuple(ops)} and operands up to {max_operand}."
        )
    test: dict[Problem, None] = {}
    for problem in _problems(random.Random(seed), ops, max_operand):
        if len(test) == n_test:
            break
        test.setdefault(problem)
    train: list[Problem] = []
    for problem in _problems(random.Random(seed + 1), ops, max_operand):
        if len(train) == n_train:
            break
        if problem not in test:
            train.append(problem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl"}
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["test"], list(test))
    return paths


def _problems(rng: random.Random, ops: Sequence[str], max_operand: int) -> Iterator[Problem]:
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(
            f"Unknown arithmetic ops {unknown or list(ops)}; use some of {list(_OPS)}."
        )
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}.")
    while True:
        op = ops[_below(rng, len(ops))]
        a, b = _below(rng, max_operand + 1), _below(rng, max_operand + 1)
        if op == "-" and a < b:
            a, b = b, a
        yield a, op, b


def _below(rng: random.Random, k: int) -> int:
    """An int in ``[0, k)`` from ``rng.random()`` only (stable across Python versions)."""
    return min(int(rng.random() * k), k - 1)


def _count_problems(ops: Sequence[str], max_operand: int) -> int:
    m = max_operand + 1
    return sum(m * (m + 1) // 2 if op == "-" else m * m for op in set(ops))


def _write_jsonl(path: Path, problems: list[Problem]) -> None:
    lines = [json.dumps(arith_row(p), ensure_ascii=True) + "\n" for p in problems]
    path.write_text("".join(lines), encoding="utf-8", newline="\n")
