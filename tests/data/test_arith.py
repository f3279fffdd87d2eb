"""Tests for roll_core/data/arith.py and the shipped data/tiny-arith files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from roll_core.data import arith_row, make_arith_rows, write_arith_dataset

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "tiny-arith"
PROMPT = re.compile(r"^What is (\d+) ([-+*]) (\d+)\?$")


def problem(row: dict[str, str]) -> tuple[int, str, int]:
    m = PROMPT.match(row["prompt"])
    assert m, row["prompt"]
    return int(m[1]), m[2], int(m[3])


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_row_format() -> None:
    assert arith_row((23, "+", 45)) == {
        "prompt": "What is 23 + 45?",
        "response": "68",
        "answer": "68",
        "domain": "math",
    }
    assert arith_row((45, "-", 23))["answer"] == "22"
    assert arith_row((7, "*", 6))["answer"] == "42"


def test_rows_are_correct_and_deterministic() -> None:
    rows = make_arith_rows(300, seed=3)
    assert rows == make_arith_rows(300, seed=3)
    assert rows != make_arith_rows(300, seed=4)
    for row in rows:
        a, op, b = problem(row)
        assert 0 <= a <= 99 and 0 <= b <= 99 and op in "+-"
        expected = a + b if op == "+" else a - b
        assert row["answer"] == row["response"] == str(expected)
        assert expected >= 0  # subtraction puts the larger operand first
        assert row["domain"] == "math"
    assert {problem(r)[1] for r in rows} == {"+", "-"}


def test_ops_and_operand_range() -> None:
    rows = make_arith_rows(50, seed=0, ops=("*",), max_operand=3)
    assert all(problem(r)[1] == "*" and max(problem(r)[0], problem(r)[2]) <= 3 for r in rows)
    with pytest.raises(ValueError, match="Unknown arithmetic ops"):
        make_arith_rows(1, seed=0, ops=("/",))


def test_written_splits_are_disjoint(tmp_path: Path) -> None:
    paths = write_arith_dataset(tmp_path, n_train=2000, n_test=100, seed=5, max_operand=20)
    train, test = read_jsonl(paths["train"]), read_jsonl(paths["test"])
    assert len(train) == 2000 and len(test) == 100
    test_problems = {problem(r) for r in test}
    assert len(test_problems) == 100  # test problems are unique
    assert test_problems.isdisjoint(problem(r) for r in train)


def test_too_many_test_problems(tmp_path: Path) -> None:
    # ops +,- with operands 0..1: 4 sums and 3 ordered differences = 7 problems
    with pytest.raises(ValueError, match="only 7 problems"):
        write_arith_dataset(tmp_path, n_train=1, n_test=7, max_operand=1)


def test_shipped_files_are_the_seed_0_output(tmp_path: Path) -> None:
    paths = write_arith_dataset(tmp_path)  # defaults: 20000 train, 500 test, seed 0
    for split in ("train", "test"):
        assert paths[split].read_bytes() == (SHIPPED / f"{split}.jsonl").read_bytes(), split
    assert sum(p.stat().st_size for p in paths.values()) < 2_000_000
    assert len(read_jsonl(SHIPPED / "test.jsonl")) == 500
