"""Generate data/tiny-code: tiny Python problems with tests, and a math + code mix.

    python data/tiny-code/generate.py          # rewrites the files next to this script

Deterministic (seeded); standard library only. tests/rewards/test_tiny_code_data.py checks
the files equal this script's output and that every reference solution passes its tests in
the real sandbox.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARITH = HERE.parent / "tiny-arith"

# (prompt template, reference solution template, test generator kind)
STDIO_TASKS = [
    (
        "Write a Python program that reads an integer n from stdin and prints n * {k}.",
        "n = int(input())\nprint(n * {k})\n",
        lambda k, x: x * k,
    ),
    (
        "Write a Python program that reads an integer n from stdin and prints n + {k}.",
        "n = int(input())\nprint(n + {k})\n",
        lambda k, x: x + k,
    ),
    (
        "Write a Python program that reads an integer n from stdin and prints n modulo {k}.",
        "n = int(input())\nprint(n % {k})\n",
        lambda k, x: x % k,
    ),
]
ASSERT_TASKS = [
    (
        "Write a Python function f(x) that returns x * {k}.",
        "def f(x):\n    return x * {k}\n",
        lambda k, x: x * k,
    ),
    (
        "Write a Python function f(x) that returns the larger of x and {k}.",
        "def f(x):\n    return max(x, {k})\n",
        lambda k, x: max(x, k),
    ),
]


def code_row(rng: random.Random) -> dict[str, object]:
    """One problem: stdin/stdout pairs or asserts, three cases, a reference solution."""
    stdio = rng.random() < 0.5
    prompt, solution, fn = rng.choice(STDIO_TASKS if stdio else ASSERT_TASKS)
    k = rng.randint(2, 9)
    xs = rng.sample(range(0, 100), 3)
    if stdio:
        tests: object = [{"input": f"{x}\n", "output": f"{fn(k, x)}\n"} for x in xs]
    else:
        tests = [f"assert f({x}) == {fn(k, x)}" for x in xs]
    return {
        "prompt": prompt.format(k=k) + " Answer with one ```python code block.",
        "answer": "```python\n" + solution.format(k=k) + "```",
        "domain": "code",
        "tests": json.dumps(tests),  # a JSON string: one column type for both forms
    }


def write(path: Path, rows: list[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def arith_rows(split: str, count: int) -> list[dict[str, object]]:
    with open(ARITH / f"{split}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:count]
    return [{"prompt": r["prompt"], "answer": r["answer"], "domain": "math"} for r in rows]


def main() -> None:
    rng = random.Random(0)
    train = [code_row(rng) for _ in range(200)]
    test = [code_row(rng) for _ in range(20)]
    write(HERE / "train.jsonl", train)
    write(HERE / "test.jsonl", test)
    mixed = HERE / "mixed"
    mixed.mkdir(exist_ok=True)
    for split, code, count in (("train", train, 200), ("test", test, 20)):
        rows = [row for pair in zip(arith_rows(split, count), code, strict=True) for row in pair]
        write(mixed / f"{split}.jsonl", rows)


if __name__ == "__main__":
    main()
