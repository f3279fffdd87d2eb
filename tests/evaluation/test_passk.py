"""pass@k (Chen et al. 2021): hand-computed values and its defining properties."""

from __future__ import annotations

import math

import pytest

from roll_core.evaluation.passk import ks_for, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (10, 5, 3, 11 / 12),  # 1 - C(5,3)/C(10,3) = 1 - 10/120
        (4, 0, 4, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (4, 4, 1, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_unbiased_differs_from_the_plug_in_estimate() -> None:
    # n=4, c=2, k=2: unbiased 5/6 = 0.8333; plug-in 1 - (1 - 2/4)^2 = 0.75
    assert pass_at_k(4, 2, 2) - (1 - (1 - 2 / 4) ** 2) == pytest.approx(5 / 6 - 0.75)


def test_monotone_in_k_and_c() -> None:
    n = 8
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)
    for k in range(1, n + 1):
        values = [pass_at_k(n, c, k) for c in range(n + 1)]
        assert values == sorted(values)


def test_matches_the_papers_product_form() -> None:
    # the numerically stable form of the paper's code: 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    for n, c, k in [(20, 3, 5), (16, 7, 4), (9, 1, 8)]:
        product = math.prod(1 - k / i for i in range(n - c + 1, n + 1))
        assert pass_at_k(n, c, k) == pytest.approx(1 - product)


def test_mean_over_problems() -> None:
    # problems with 1 and 3 correct of 4: pass@2 = (0.5 + 1.0) / 2
    assert mean_pass_at_k(4, [1, 3], 2) == pytest.approx(0.75)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_reported_ks() -> None:
    assert ks_for(1) == [1]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(8) == [1, 2, 4, 8]
