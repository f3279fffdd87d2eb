"""`roll report` (and `roll eval` of a run) through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from roll_core.runs import Run
from roll_core.tracking.jsonl import JsonlTracker, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def fake_rl_run(runs: Path, rid: str, scale: float) -> None:
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
    for step in range(1, 5):
        tracker.log(
            step,
            {
                "rollout/reward_mean": scale * step,
                "actor/entropy": 1.0,
                "time/rollout": 2.0,
                "time/train": 1.0,
            },
        )
    tracker.close()


def test_report_overlays_runs(roll, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    fake_rl_run(runs, "low", 0.1)
    fake_rl_run(runs, "high", 0.2)
    res = roll("report", "low", "high", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    out = runs / "low" / "report-compare"
    assert res.stdout.splitlines() == [
        str(out / "reward.png"),
        str(out / "entropy.png"),
        str(out / "time.png"),
        f"plotted data: {out / 'report.json'}",
    ]
    data = json.loads((out / "report.json").read_text())
    reward = data["panels"]["reward"]["series"]
    assert reward["high"]["rollout/reward_mean"]["value"] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    with Image.open(out / "time.png") as img:
        assert img.size == (800, 700)  # two runs: two stacked subplots of 350 px
    bad = roll("report", "low", "nope", "--runs-dir", str(runs))
    assert bad.returncode == 2 and "no run 'nope'" in bad.stderr


@pytest.mark.slow
def test_a_trained_run_reports_evaluates_and_generates(roll, tiny_recipe, tmp_path: Path) -> None:
    recipe = tiny_recipe(
        trainer={"max_steps": 4, "micro_batch_size": 8, "grad_accum_steps": 1},
        checkpoint={"every_steps": 4, "keep_last": 1},
    )
    trained = roll("sft", str(recipe), "--run-id", "tiny")
    assert trained.returncode == 0, trained.stderr
    runs = tmp_path / "runs"
    res = roll("report", "tiny", "--runs-dir", str(runs))
    assert res.returncode == 0, res.stderr
    loss = runs / "tiny" / "report" / "loss.png"
    with Image.open(loss) as img:
        assert img.size == (800, 450)
    data = json.loads((runs / "tiny" / "report" / "report.json").read_text())
    logged = [r for r in read_metrics(runs / "tiny" / "metrics.jsonl") if "train/loss" in r]
    plotted = data["panels"]["loss"]["series"]["tiny"]["train/loss"]
    assert plotted["step"] == [float(r["step"]) for r in logged]
    assert plotted["value"] == [r["train/loss"] for r in logged]
    assert "eval/exact_match" in data["panels"]["reward"]["series"]["tiny"]

    # the run id names its final model; the SFT run's response column is the answer
    data_file = str(ROOT / "data/tiny-arith/test.jsonl")
    ev = roll("eval", "tiny", "--data", data_file, "--max-rows", "4", "--runs-dir", str(runs))
    assert ev.returncode == 0, ev.stderr
    assert "model: run tiny (final)" in ev.stdout
    rows = [json.loads(x) for x in (runs / "tiny/eval/test.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["33", "91", "17", rows[3]["answer"]]
    assert all(n <= 4 for r in rows for n in r["lengths"])  # the run's eval.max_new_tokens

    gen = roll("generate", "tiny", "What is 75 - 42?", "--runs-dir", str(runs))
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.removesuffix("\n") == rows[0]["responses"][0]  # greedy, same prompt
