"""SwanLab in offline mode: writes its run under log_dir and never opens a connection.

What was found in swanlab 0.10.3: ``mode="offline"`` needs no account and no network (it
saves a run for a later ``swanlab sync``); ``mode="local"`` needs the separate ``swanboard``
package and binds a port, so it is not used.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest

swanlab = pytest.importorskip("swanlab")

from roll_core.tracking.swanlab_tracker import SwanLabTracker  # noqa: E402


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record (and refuse) every outgoing connection attempt of this test's threads: the
    test's own and the ones started during it (SwanLab's). Threads an earlier test of the same
    worker left running (a tinker client's heartbeat to a server that is gone) are not
    SwanLab's: their attempts are refused but not counted."""
    attempts: list[Any] = []
    before = {t.ident for t in threading.enumerate()} - {threading.get_ident()}

    def refuse(self: socket.socket, address: Any) -> None:
        if threading.get_ident() not in before:
            attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("SWANLAB_MODE", "online")  # must not win over the forced offline mode
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.delenv("SWANLAB_WEBHOOK", raising=False)
    return attempts


def _logged_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    """(key, step) -> value from the run's .swanlab record log (SwanLab's own reader)."""
    store = pytest.importorskip("swanlab.sdk.internal.core_python.store")
    record_pb2 = pytest.importorskip("swanlab.proto.swanlab.record.v1.record_pb2")
    reader = store.DataStoreReader()
    reader.open(next(run_dir.glob("*.swanlab")))
    found = {}
    for raw in reader:
        record = record_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar":
            found[(record.scalar.key, record.scalar.step)] = record.scalar.value.number
    reader.close()
    return found


def test_offline_run_is_written_under_log_dir(tmp_path: Path, no_network: list[Any]) -> None:
    log_dir = tmp_path / "swanlab"
    tracker = SwanLabTracker(
        log_dir,
        "roll-tests",
        "brisk-otter-42",
        {"lr": 1e-5, "path": tmp_path},
        system_metrics=False,
    )
    try:
        assert tracker.run_dir.parent == log_dir
        tracker.log(1, {"train/loss": 2.5, "eval/exact_match": 0.5})
        tracker.log(2, {"train/loss": 1.25})
    finally:
        tracker.close()
    tracker.close()

    assert no_network == []
    assert not swanlab.has_run()  # finished, hooks released
    run_dir = tracker.run_dir
    assert run_dir.name.startswith("run-")
    assert list(run_dir.glob("*.swanlab"))
    assert "lr" in (run_dir / "files" / "config.yaml").read_text()
    assert _logged_scalars(run_dir) == {
        ("train/loss", 1): 2.5,
        ("eval/exact_match", 1): 0.5,
        ("train/loss", 2): 1.25,
    }


def test_build_tracking_puts_swanlab_under_run_dir(tmp_path: Path, no_network: list[Any]) -> None:
    from roll_core.tracking import build_tracking

    tracking = build_tracking(
        backends=["swanlab"],
        run_dir=tmp_path,
        run_name="brisk-otter-42",
        project="roll-tests",
        config={"trainer": {"max_steps": 2}},
        total_steps=2,
    )
    with tracking:
        tracking.log(1, {"train/loss": 0.75})
    assert no_network == []
    (run_dir,) = (tmp_path / "swanlab").glob("run-*")
    assert _logged_scalars(run_dir) == {("train/loss", 1): 0.75}
