"""An unreachable hub fails in seconds with the clear error, not after minutes of retries."""

from __future__ import annotations

import socket
import time

import pytest

from roll_core.errors import ModelError
from roll_core.models import loading


def _closed_port() -> int:
    with socket.socket() as s:  # bind, then close: nothing listens there any more
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    loading.hub_unreachable.cache_clear()
    yield
    loading.hub_unreachable.cache_clear()


def test_unreachable_hub_is_one_try_then_the_offline_error(no_hub) -> None:
    calls: list[str] = []
    start = time.monotonic()
    with pytest.raises(ModelError, match=r"hub \(127\.0\.0\.1:\d+\) cannot be reached") as exc:
        loading._load("model", "some-org/not-cached", "some-org/not-cached", calls.append)
    assert time.monotonic() - start < loading.HUB_PROBE_TIMEOUT_S + 1
    assert calls == []  # from_pretrained (and its retries) never ran
    assert "builtin:tiny-qwen3" in (exc.value.hint or "")


def test_cached_model_loads_from_the_cache_without_the_hub(no_hub, monkeypatch) -> None:
    monkeypatch.setattr(loading, "_cached_hub_config", lambda repo: {"model_type": "qwen3"})
    seen: list[dict] = []

    def loader(path: str, **kwargs: object) -> str:
        seen.append(kwargs)
        return path

    assert loading._load("model", "org/cached", "org/cached", loader) == "org/cached"
    assert seen == [{"local_files_only": True}]


def test_offline_mode_and_local_dirs_never_probe(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "hub_unreachable", lambda: pytest.fail("probed the hub"))
    assert loading._load("model", "org/x", "org/x", lambda p: p) == "org/x"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert loading._load("model", str(tmp_path), str(tmp_path), lambda p: p) == str(tmp_path)
