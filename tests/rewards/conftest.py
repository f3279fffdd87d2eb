"""Put this directory on sys.path so ``reward_fns_for_tests:NAME`` dotted paths import."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def user_fns(monkeypatch: pytest.MonkeyPatch):
    """The test user-reward module, importable by dotted path (also in worker processes)."""
    monkeypatch.syspath_prepend(str(HERE))
    import reward_fns_for_tests

    reward_fns_for_tests.RELEASE.clear()
    yield reward_fns_for_tests
    reward_fns_for_tests.RELEASE.set()  # let any hung thread finish
