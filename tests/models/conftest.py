"""Fixtures for the model tests: a private roll cache per test, one materialized tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.models import materialize_builtin


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty roll cache that ROLL_CACHE_DIR points to."""
    cache = tmp_path / "roll-cache"
    monkeypatch.setenv("ROLL_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny-qwen3 materialized once for the session (treat as read-only)."""
    return materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("shared-cache"))
