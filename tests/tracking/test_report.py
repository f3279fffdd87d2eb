"""roll report: which keys each panel plots, the figures' data, and real PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from roll_core.errors import UsageError
from roll_core.runs import Run
from roll_core.tracking.jsonl import JsonlTracker
from roll_core.tracking.report import (
    PANELS,
    line_figure,
    panel_keys,
    report_runs,
    series_of,
    time_figure,
)


def rlvr_run(runs: Path, rid: str, *, offset: float = 0.0, steps: int = 6) -> Run:
    """A run directory whose metrics.jsonl is written by the real tracker."""
    run = Run.create(
        runs,
        config_yaml="pipeline: rlvr\n",
        name=rid,
        pipeline="rlvr",
        command=[],
        recipe=None,
        run_id=rid,
    )
    tracker = JsonlTracker(run.metrics_path)
    for step in range(1, steps + 1):
        metrics = {
            "rollout/reward_mean": 0.1 * step + offset,
            "actor/pg_loss": 1.0 / step,
            "actor/ppo_kl": 0.01 * step,
            "actor/reward_kl_coef": 0.5,  # a coefficient, not a KL: not plotted
            "actor/entropy": 2.0 - 0.1 * step,
            "rollout/response_length_mean": 4.0 + step,
            "time/rollout": 1.5,
            "time/train": 0.5 + offset,
        }
        if step % 3 == 0:
            metrics["eval/accuracy"] = {3: 0.2, 6: 0.4}[step]
        tracker.log(step, metrics)
    tracker.close()
    return run


def test_panel_keys() -> None:
    keys = ["actor/ppo_kl", "actor/reward_kl", "actor/kl_coef", "actor/entropy", "train/loss"]
    by_name = {p.name: p for p in PANELS}
    assert panel_keys(by_name["kl"], keys) == ["actor/ppo_kl", "actor/reward_kl"]
    assert panel_keys(by_name["loss"], keys) == ["train/loss"]
    assert panel_keys(by_name["reward"], keys) == []


def test_series_skips_missing_and_nan() -> None:
    records = [
        {"step": 2, "a": 1.0},
        {"step": 1, "a": 0.5},
        {"step": 3},
        {"step": 4, "a": float("nan")},
        {"step": 5, "a": True},
    ]
    assert series_of(records, "a") == {"step": [1.0, 2.0], "value": [0.5, 1.0]}


def test_line_figure_draws_exactly_the_series() -> None:
    plotted = {"a": {"x/y": {"step": [1.0, 2.0, 3.0], "value": [3.0, 1.0, 2.0]}}}
    fig = line_figure("t", plotted, several=False)
    (line,) = fig.axes[0].lines
    assert line.get_xdata().tolist() == [1.0, 2.0, 3.0]
    assert line.get_ydata().tolist() == [3.0, 1.0, 2.0]
    assert line.get_label() == "x/y"
    assert fig.get_size_inches().tolist() == [8.0, 4.5] and fig.dpi == 100


def test_time_figure_stacks_phases() -> None:
    times = {
        "r": {
            "time/a": {"step": [1.0, 2.0], "value": [1.0, 2.0]},
            "time/b": {"step": [2.0], "value": [5.0]},
        }
    }
    fig = time_figure(times)
    polys = fig.axes[0].collections
    assert len(polys) == 2  # one band per phase
    # the top band's upper edge at step 2 is a + b = 7 (b missing at step 1 counts 0)
    top = polys[1].get_paths()[0].vertices
    assert top[:, 1].max() == pytest.approx(7.0)


def test_report_of_two_runs_overlays_them(tmp_path: Path) -> None:
    rlvr_run(tmp_path, "run-a")
    rlvr_run(tmp_path, "run-b", offset=1.0)
    report = report_runs(["run-a", "run-b"], runs_dir=tmp_path)
    assert report.out_dir == tmp_path / "run-a" / "report-compare"
    names = sorted(p.name for p in report.files)
    assert names == [
        "entropy.png",
        "kl.png",
        "loss.png",
        "response_length.png",
        "reward.png",
        "time.png",
    ]
    for path in report.files:
        with Image.open(path) as img:
            assert img.format == "PNG"
            width, height = img.size
            assert len(img.convert("RGB").getcolors(maxcolors=100000) or []) > 10  # not blank
        assert (width, height) == ((800, 700) if path.name == "time.png" else (800, 450))
    data = json.loads((report.out_dir / "report.json").read_text())
    assert data["runs"] == ["run-a", "run-b"]
    reward = data["panels"]["reward"]["series"]
    assert reward["run-b"]["rollout/reward_mean"]["value"] == pytest.approx(
        [1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    )
    assert reward["run-a"]["eval/accuracy"] == {"step": [3.0, 6.0], "value": [0.2, 0.4]}
    assert list(data["panels"]["kl"]["series"]["run-a"]) == ["actor/ppo_kl"]
    assert data["panels"]["time"]["series"]["run-b"]["time/train"]["value"] == [1.5] * 6


def test_unknown_and_empty_runs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no run 'nope'"):
        report_runs(["nope"], runs_dir=tmp_path)
    Run.create(
        tmp_path, config_yaml="", name="e", pipeline="sft", command=[], recipe=None, run_id="empty"
    )
    with pytest.raises(UsageError, match="nothing to plot"):
        report_runs(["empty"], runs_dir=tmp_path)
