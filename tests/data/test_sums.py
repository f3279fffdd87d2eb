"""The multi-term sums generator of the long-tail benchmark."""

from __future__ import annotations

from roll_core.data.sums import make_sums_rows, sums_row


def test_row_by_hand() -> None:
    assert sums_row([3, 5, 2, 7]) == {
        "prompt": "3+5+2+7=",
        "response": "8 10 17",
        "answer": "17",
        "domain": "math",
    }


def test_lengths_are_long_tailed_and_seeded() -> None:
    rows = make_sums_rows(2000, seed=0)
    assert rows == make_sums_rows(2000, seed=0)
    terms = [r["prompt"].count("+") + 1 for r in rows]
    assert min(terms) == 2 and max(terms) >= 25 and max(terms) <= 30
    short = sum(k <= 5 for k in terms) / len(terms)
    long = sum(k >= 20 for k in terms) / len(terms)
    assert short > 0.4 and 0.02 < long < 0.2  # most short, a real tail
    for r in rows[:50]:
        parts = [int(x) for x in r["prompt"][:-1].split("+")]
        assert r["answer"] == str(sum(parts)) == r["response"].split()[-1]
