"""Fixtures for the data tests: the built-in byte-level tokenizer and a private datasets cache."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from roll_core.models import load_tokenizer, resolve_model_path


@pytest.fixture(scope="session")
def tokenizer(cache_dir: Path):
    """builtin:tiny-qwen3's tokenizer, loaded through the normal path (one token per byte)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLL_CACHE_DIR", str(cache_dir))
        return load_tokenizer(resolve_model_path("builtin:tiny-qwen3"))


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the Arrow files `datasets` writes for local files out of the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")
