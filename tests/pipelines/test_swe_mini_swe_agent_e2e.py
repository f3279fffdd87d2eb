"""`roll train agentic` trains mini-swe-agent, unchanged, on a SWE task (issue 41): the real
`roll` CLI on recipes/swe-mini-swe-agent-tiny.yaml made small, `mini` running inside each
episode's sandbox and reaching the endpoint through the sandbox's one way out.

mini-swe-agent lives in its own virtualenv (it is not a roll dependency): set ROLL_MSWEA_PYTHON
to that venv's python, or put its `mini` on PATH; without either the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def mswea_python() -> str | None:
    """The python of mini-swe-agent's venv: $ROLL_MSWEA_PYTHON, else the one beside `mini`."""
    python = os.environ.get("ROLL_MSWEA_PYTHON")
    if python:
        return python
    mini = shutil.which("mini")
    if mini is None:
        return None
    beside = Path(mini).parent / "python"
    return str(beside) if beside.exists() else None


PYTHON = mswea_python()


def _namespaces() -> bool:
    from roll_core.sandbox.local import namespaces_work

    return namespaces_work(sys.executable, True, 65534)[0]


@pytest.mark.slow
@pytest.mark.skipif(
    PYTHON is None,
    reason="mini-swe-agent is not installed: `python -m venv V && V/bin/pip install "
    "mini-swe-agent`, then set ROLL_MSWEA_PYTHON=V/bin/python (or put V/bin on PATH)",
)
def test_train_agentic_trains_mini_swe_agent_unchanged(roll, tmp_path: Path) -> None:
    if not _namespaces():
        pytest.skip("the harness's sandbox needs user namespaces")
    from tests.swe.test_tasks import make_task

    make_task(tmp_path / "tasks")
    data = yaml.safe_load((ROOT / "recipes/swe-mini-swe-agent-tiny.yaml").read_text())
    data["runs_dir"] = str(tmp_path / "runs")
    env = data["envs"][0]
    env["options"].update(tasks=str(tmp_path / "tasks"), python=PYTHON)
    command = env["options"]["command"]
    command[command.index("agent.step_limit=3")] = "agent.step_limit=2"
    env["groups_per_step"] = 1
    data["trainer"]["max_steps"] = 1
    data["checkpoint"]["every_steps"] = 1
    data["tracking"]["backends"] = ["jsonl"]
    recipe = tmp_path / "mini.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    res = roll("train", "agentic", str(recipe), "--run-id", "mini", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    run = tmp_path / "runs/mini"
    [step] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # both episodes played: mini started in its sandbox, called the model through the way
    # out (step_limit 2: two calls each), exited by itself, and its workspace was graded
    assert step["rollout/env_errors"] == 0 and step["rollout/env_timeouts"] == 0
    assert step["rollout/harness/episodes_completed"] == 2
    assert step["rollout/episode_length"] == 2 and step["rollout/gen_calls"] == 4
    assert step["rollout/env/model_connections"] >= 1 and step["rollout/env/exit_code"] == 0
    assert step["rollout/env/grade_s"] > 0 and step["rollout/env/resolved"] == 0
    # every generated token of every call: the trainer's log-prob equals the sampler's
    assert step["train_infer/logprob_diff_max"] < 1e-3 and step["perf/samples"] >= 2
    rows = (run / "rollouts/step-000001.jsonl").read_text().splitlines()[1:]
    episodes = [json.loads(r)["episode"] for r in rows]
    assert {e["status"] for e in episodes} == {"done"}
    # the first prompt is mini-swe-agent's own (its text-based system prompt and the issue)
    first = json.loads(rows[0])
    prompt = bytes(i for i in first["ids"][: first["start"]] if i < 256).decode("utf-8", "replace")
    assert "mswea_bash_command" in prompt and "Please solve this issue" in prompt
