"""`roll view` through the real CLI: a tiny rlvr run's rollout records, exported to one HTML
file; resuming after a kill continues the same record; a run without records is an error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.tracking.tiny_runs import rlvr_recipe

pytestmark = pytest.mark.slow


def embedded(html: str) -> dict:
    """The runs and, under "stepData", each run's steps, from the JSON script elements."""
    found = re.search(r'<script type="application/json" id="roll-data">(.*?)</script>', html)
    assert found is not None
    data = json.loads(found.group(1))
    data["stepData"] = {}
    pattern = r'<script type="application/json" data-run="(\d+)" data-step="(\d+)">(.*?)</script>'
    for run, step, text in re.findall(pattern, html):
        data["stepData"].setdefault(run, {})[step] = json.loads(text)
    return data


def test_export_holds_every_recorded_step_and_the_page(roll, tmp_path: Path) -> None:
    res = roll("train", "rlvr", str(rlvr_recipe(tmp_path, steps=2)), "--run-id", "v", timeout=240)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs/v"
    files = sorted(p.name for p in (run / "rollouts").iterdir())
    assert files == ["step-000001.jsonl", "step-000002.jsonl"]
    out = tmp_path / "v.html"
    res = roll("view", "v", "--runs-dir", str(tmp_path / "runs"), "--export", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    html = out.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", ""), "no network"
    assert "function renderTokens" in html and "<style>" in html  # self-contained
    data = embedded(html)
    [view_run] = data["runs"]
    assert [s["step"] for s in view_run["steps"]] == [1, 2]
    assert [m["step"] for m in view_run["metrics"]] == [1, 2]
    for step in (1, 2):
        lines = (run / f"rollouts/step-{step:06d}.jsonl").read_text().splitlines()
        rows = data["stepData"]["0"][str(step)]["rows"]
        assert rows == [json.loads(x) for x in lines[1:]]
        # 8 recorded rows a step (samples_per_step), whole groups of n=4
        assert len(rows) == 8 and len({r["group"] for r in rows}) == 2
        for r in rows:
            n_resp = len(r["ids"]) - r["start"]
            assert n_resp == r["length"] == len(r["behaviour_lp"]) == len(r["advantage"])
            # one update on on-policy samples: the trainer's log-probs are the sampler's (fp32)
            assert (
                max(abs(a - b) for a, b in zip(r["trainer_lp"], r["behaviour_lp"], strict=True))
                < 1e-3
            )
            assert r["staleness"] == 0 and r["policy_version"] == step - 1
            assert r["prompt"].endswith("assistant\n") and r["reward_parts"]["domain"] == "math"


def test_resume_after_a_kill_continues_the_record(roll, tmp_path: Path) -> None:
    recipe = str(rlvr_recipe(tmp_path, steps=4))
    kill = {"ROLL_DEBUG_KILL_IN_SAVE": "4"}  # killed saving step 4: resumes from step-2
    res = roll("train", "rlvr", recipe, "--run-id", "k", timeout=240, env=kill)
    assert res.returncode != 0
    rollouts = tmp_path / "runs/k/rollouts"
    assert sorted(p.name for p in rollouts.iterdir()) == [
        f"step-00000{s}.jsonl" for s in (1, 2, 3, 4)
    ]
    # mark the files: a step the checkpoint holds must stay, the redone ones be rewritten
    for step in (2, 4):
        path = rollouts / f"step-00000{step}.jsonl"
        path.write_text(json.dumps({"step": step, "summary": {"marker": True}}) + "\n")
    res = roll("resume", "k", "--runs-dir", str(tmp_path / "runs"), timeout=240)
    assert res.returncode == 0, res.stderr
    heads = {
        s: json.loads((rollouts / f"step-00000{s}.jsonl").read_text().splitlines()[0])
        for s in (1, 2, 3, 4)
    }
    assert heads[2]["summary"] == {"marker": True}
    assert "marker" not in heads[4]["summary"] and heads[4]["summary"]["rows"] == 8
    assert sorted(p.name for p in rollouts.iterdir()) == [
        f"step-00000{s}.jsonl" for s in (1, 2, 3, 4)
    ]


def test_records_off_and_a_run_without_them(roll, tmp_path: Path) -> None:
    off = {"backends": ["jsonl"], "rollout_records": {"enabled": False}}
    recipe = str(rlvr_recipe(tmp_path, steps=1, tracking=off))
    res = roll("train", "rlvr", recipe, "--run-id", "off", timeout=240)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "runs/off/rollouts").exists()
    res = roll("view", "off", "--runs-dir", str(tmp_path / "runs"), "--export", "x.html")
    assert res.returncode != 0
    assert "run off has no rollout records" in res.stderr
    assert "Traceback" not in res.stderr
