"""Multi-term sums that write every partial sum: a task whose response length follows the
number of terms, for the long-tail rollout benchmark (benchmarks/rlvr_async.py).

Every row::

    {"prompt": "3+5+2+7=", "response": "8 10 17", "answer": "17", "domain": "math"}

* Terms are digits 1-9; the response is the running sum after each added term, so a problem
  with ``k`` terms has ``k - 1`` partial sums (about ``3.5 * k`` tokens with the byte-level
  tokenizer) and the last number is the answer (the math reward reads the last number).
* The number of terms ``k`` in ``[min_terms, max_terms]`` is drawn with probability
  proportional to ``k ** -alpha``: most problems are short, a few are long, a long-tailed
  length distribution like the reasoning lengths of real RLVR.
* Randomness comes only from :meth:`random.Random.random`, so a seed gives the same rows
  everywhere. Train and test use different seeds; overlap is possible but rare for long
  problems (short ones repeat: with 2 terms there are only 81 problems).
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def _terms_count(rng: random.Random, min_terms: int, max_terms: int, alpha: float) -> int:
    ks = list(range(min_terms, max_terms + 1))
    weights = [k**-alpha for k in ks]
    x = rng.random() * sum(weights)
    for k, w in zip(ks, weights, strict=True):
        x -= w
        if x < 0:
            return k
    return ks[-1]


def sums_row(terms: list[int]) -> dict[str, str]:
    """The row of one problem (its terms)."""
    partial, total = [], terms[0]
    for t in terms[1:]:
        total += t
        partial.append(str(total))
    return {
        "prompt": "+".join(map(str, terms)) + "=",
        "response": " ".join(partial),
        "answer": str(total),
        "domain": "math",
    }


def make_sums_rows(
    n: int, *, seed: int, min_terms: int = 2, max_terms: int = 30, alpha: float = 1.2
) -> list[dict[str, str]]:
    """``n`` rows drawn with ``random.Random(seed)`` (see the module docstring)."""
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = _terms_count(rng, min_terms, max_terms, alpha)
        rows.append(sums_row([1 + int(rng.random() * 9) for _ in range(k)]))
    return rows


def write_sums_dataset(
    out_dir: str | Path, *, n_train: int = 20000, n_test: int = 200, seed: int = 0, **kw: float
) -> dict[str, Path]:
    """Write ``train.jsonl`` (seed ``seed + 1``) and ``test.jsonl`` (seed ``seed``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, s in (("train", n_train, seed + 1), ("test", n_test, seed)):
        path = out / f"{split}.jsonl"
        rows = make_sums_rows(n, seed=s, **kw)  # type: ignore[arg-type]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[split] = path
    return paths
