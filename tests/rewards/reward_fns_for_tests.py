"""User reward functions for tests/rewards, loaded by dotted path ``reward_fns_for_tests:NAME``.

The tests put this directory on ``sys.path`` (pytest runs with ``--import-mode=importlib``).
"""

from __future__ import annotations

import os
import threading

from roll_core.rewards import RewardResult, RewardSample

RELEASE = threading.Event()
"""Set by a test to let ``hang`` return (only matters under thread isolation)."""

NOT_A_FUNCTION = 42


def length_score(sample: RewardSample) -> float:
    """Response length in characters / 10."""
    return len(sample.response) / 10


def keyword(sample: RewardSample, *, word: str = "yes", bonus: float = 1.0) -> RewardResult:
    """``bonus`` when ``word`` is in the response, with ``correct`` in info."""
    hit = word in sample.response
    return RewardResult(bonus if hit else 0.0, {"correct": hit})


def hang(sample: RewardSample) -> float:
    """Never returns on its own (waits up to a minute for RELEASE)."""
    RELEASE.wait(60)
    return 1.0


def boom(sample: RewardSample) -> float:
    """Raises for a response that says so, else 0.5."""
    if "boom" in sample.response:
        raise ZeroDivisionError("boom in the response")
    return 0.5


def returns_text(sample: RewardSample) -> str:
    """Returns the wrong type."""
    return "high"


def returns_nan(sample: RewardSample) -> float:
    """Returns a NaN score."""
    return float("nan")


def dies(sample: RewardSample) -> float:
    """Kills its own process (a worker crash)."""
    os._exit(3)
