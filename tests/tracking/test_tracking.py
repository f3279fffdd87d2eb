"""build_tracking and the Tracking fan-out: registry, errors, conversion, failing trackers."""

from __future__ import annotations

import io
import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from roll_core.errors import ConfigError
from roll_core.tracking import (
    TRACKERS,
    JsonlTracker,
    Tracker,
    Tracking,
    build_tracking,
    read_metrics,
    resolve_backends,
    to_scalar,
)
from roll_core.tracking.console import ConsoleTracker


class Recorder:
    """A tracker that remembers what it got."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.closed = 0

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed += 1


class Broken(Recorder):
    """A tracker whose log always fails (a dashboard that lost its disk, say)."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        raise OSError("disk full")


def _build(tmp_path: Path, backends: list[str], **kwargs: Any) -> Tracking:
    args: dict[str, Any] = {
        "run_dir": tmp_path / "run",
        "run_name": "brisk-otter-42",
        "project": "roll",
        "config": {"lr": 0.1},
        "total_steps": 10,
        "console": Console(file=io.StringIO()),
    }
    return build_tracking(backends=backends, **(args | kwargs))


def test_registry_names() -> None:
    assert set(TRACKERS) == {"console", "jsonl", "tensorboard", "swanlab", "wandb"}


def test_jsonl_is_always_on_and_first() -> None:
    assert resolve_backends([]) == ["jsonl"]
    assert resolve_backends(["console", "jsonl", "console"]) == ["jsonl", "console"]


def test_build_writes_metrics_jsonl_even_when_not_listed(tmp_path: Path) -> None:
    tracking = _build(tmp_path, ["console"])
    assert tracking.names == ["jsonl", "console"]
    assert isinstance(tracking, Tracker)
    with tracking:
        tracking.log(1, {"train/loss": 0.5})
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["train/loss"] == 0.5


def test_build_with_tensorboard_writes_under_run_dir(tmp_path: Path) -> None:
    tracking = _build(tmp_path, ["tensorboard"])
    tracking.log(1, {"train/loss": 0.5})
    tracking.close()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_backend_names_valid_ones_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _build(tmp_path, ["console", "tensorbord"])
    message = str(info.value)
    assert "unknown backend 'tensorbord'" in message
    assert "Did you mean 'tensorboard'?" in message
    assert "console, jsonl, swanlab, tensorboard, wandb" in message
    assert info.value.exit_code == 2
    assert not (tmp_path / "run").exists()  # nothing opened before validation


def test_unknown_backend_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_backends(["mlflow"])
    assert "Did you mean" not in str(info.value)


def test_wandb_missing_is_a_config_error_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError) as info:
        _build(tmp_path, ["wandb"])
    assert "pip install wandb" in str(info.value)
    assert "tracking.backends" in str(info.value)


def test_wandb_defaults_to_offline_and_respects_wandb_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    run = Recorder()
    run.finish = run.close  # type: ignore[attr-defined]
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(kw) or run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)

    monkeypatch.delenv("WANDB_MODE", raising=False)
    tracking = _build(tmp_path, ["wandb"])
    tracking.log(3, {"train/loss": 0.5})
    tracking.close()
    assert calls[0]["mode"] == "offline" and calls[0]["name"] == "brisk-otter-42"
    assert calls[0]["dir"] == str(tmp_path / "run")
    assert run.closed == 1

    monkeypatch.setenv("WANDB_MODE", "disabled")
    _build(tmp_path, ["wandb"]).close()
    assert calls[1]["mode"] == "disabled"


def test_resume_cuts_metrics_back_to_start_step(tmp_path: Path) -> None:
    tracking = _build(tmp_path, [])
    for step in range(1, 6):
        tracking.log(step, {"loss": float(step)})
    tracking.close()

    tracking = _build(tmp_path, [], start_step=3)
    tracking.log(4, {"loss": 4.5})
    tracking.close()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]


def test_log_converts_tensors_and_numpy_scalars(tmp_path: Path) -> None:
    recorder = Recorder()
    tracking = Tracking({"rec": recorder})
    tracking.log(
        np.int64(2),
        {
            "a": torch.tensor(0.5),
            "b": np.float32(0.25),
            "c": torch.tensor([3]),
            "d": np.array(1.5),
            "e": True,
            "f": 7,
        },
    )
    step, metrics = recorder.logged[0]
    assert step == 2 and type(step) is int
    assert metrics == {"a": 0.5, "b": 0.25, "c": 3, "d": 1.5, "e": 1, "f": 7}
    assert [type(v) for v in metrics.values()] == [float, float, int, float, int, int]
    json.dumps(metrics)  # plain Python numbers only


def test_non_scalar_metric_is_a_type_error_naming_the_key() -> None:
    with pytest.raises(TypeError, match="'x' is not a scalar"):
        to_scalar("x", torch.ones(2))
    with pytest.raises(TypeError, match="'y' must be a number"):
        to_scalar("y", "high")


def test_failing_tracker_is_warned_once_and_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = Recorder(), Broken()
    tracking = Tracking({"good": good, "bad": bad})
    for step in (1, 2, 3):
        tracking.log(step, {"loss": 1.0})
    tracking.close()

    err = capsys.readouterr().err
    assert err.count("tracker 'bad' failed during log: OSError: disk full") == 1
    assert "disabled for the rest of this run" in err
    assert [step for step, _ in good.logged] == [1, 2, 3]
    assert tracking.disabled == ["bad"]
    assert bad.closed == 1 and good.closed == 1


def test_jsonl_failure_propagates(tmp_path: Path) -> None:
    jsonl = JsonlTracker(tmp_path / "m.jsonl")
    jsonl.close()  # a closed file: every log raises
    other = Recorder()
    tracking = Tracking({"jsonl": jsonl, "other": other}, critical=("jsonl",))
    with pytest.raises(ValueError, match="closed"):
        tracking.log(1, {"loss": 1.0})
    assert other.logged == []


def test_close_closes_everything_even_if_one_close_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class BadClose(Recorder):
        def close(self) -> None:
            raise RuntimeError("boom")

    last = Recorder()
    Tracking({"bad": BadClose(), "last": last}).close()
    assert last.closed == 1
    assert "tracker 'bad' failed during close: RuntimeError: boom" in capsys.readouterr().err


def test_failed_build_closes_what_it_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    monkeypatch.setattr(ConsoleTracker, "close", lambda self: closed.append("console"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError):
        _build(tmp_path, ["console", "wandb"])
    assert closed == ["console"]


def test_tick_reaches_only_trackers_that_have_one_and_a_failing_one_is_dropped() -> None:
    class Ticker(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.ticks: list[int] = []

        def tick(self, step: int) -> None:
            self.ticks.append(step)
            assert type(step) is int

    class BadTicker(Ticker):
        def tick(self, step: int) -> None:
            raise RuntimeError("no screen")

    ticker, plain, bad = Ticker(), Recorder(), BadTicker()
    tracking = Tracking({"console": ticker, "jsonl": plain, "bad": bad}, critical=("jsonl",))
    tracking.tick(np.int64(3))  # type: ignore[arg-type]
    assert ticker.ticks == [3] and plain.logged == [] and tracking.disabled == ["bad"]
    assert tracking.live_progress() is None  # no tracker draws a live display
