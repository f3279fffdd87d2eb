"""pass@k, the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, section 2.1).

With n samples of a problem of which c are correct, the chance that at least one of k samples
drawn without replacement from them is correct is ``1 - C(n-c, k) / C(n, k)``; averaged over
problems it estimates pass@k without the bias of ``1 - (1 - c/n)^k``. The paper computes the
ratio as a product for numerical stability in floating point; Python's exact integer
binomials make that unnecessary here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n samples (c of them correct) include a correct one.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k includes a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per problem: the powers of two up to n, and n itself."""
    ks = {n}
    k = 1
    while k <= n:
        ks.add(k)
        k *= 2
    return sorted(ks)


def mean_pass_at_k(n: int, correct_counts: Sequence[int], k: int) -> float:
    """pass@k averaged over problems (each with n samples and its own correct count)."""
    if not correct_counts:
        raise ValueError("pass@k of no problems")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
