"""A real harness as a command (roll_core/envs/harness.py), through the rollout manager with
the scripted calculator model of tests/rollout/test_agent_endpoint.py: the command gets the
episode's endpoint in the standard variables, its model calls are the trajectory, its reward
and metrics come back, and its whole process group is killed at its timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from roll_core.backends.infer import SamplingParams
from roll_core.envs.agents import load_agent
from roll_core.errors import ConfigError
from roll_core.rollout.agentic import EnvRolloutManager, EnvSpec
from tests.rollout.test_agent_endpoint import CalcInfer, settings
from tests.rollout.test_agent_endpoint import tok as tok  # noqa: F401 - the fixture

HARNESS = """
import os, sys, time, subprocess
from openai import OpenAI
client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
tools = [{"type": "function", "function": {"name": "calc", "description": "Multiply.",
          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
out = client.chat.completions.create(model="policy", tools=tools,
    messages=[{"role": "user", "content": os.environ["ROLL_TASK"]}])
open(os.environ["ROLL_REWARD_FILE"], "w").write("0.75")
if "hang" in sys.argv:
    subprocess.Popen(["sleep", "300", "roll-harness-marker"])  # a child left behind
    time.sleep(300)
"""


def play(tok: Any, tmp_path: Path, *extra: str, timeout_s: float = 60) -> Any:
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(HARNESS))
    options = {"command": [sys.executable, str(script), *extra], "prompt": "12*34"}
    options["timeout_s"] = timeout_s
    spec = EnvSpec("harness", lambda: None, agent=load_agent("roll_core.envs.harness:run", options))
    mgr = EnvRolloutManager(infer=CalcInfer(tok), tokenizer=tok, specs=[spec], settings=settings())
    try:
        [traj] = mgr.run_episodes(spec, [0], SamplingParams(max_new_tokens=80))
        return traj
    finally:
        mgr.close()


def test_a_command_harness_is_an_agent_episode(tok: Any, tmp_path: Path) -> None:
    traj = play(tok, tmp_path)
    assert (traj.status, traj.error) == ("done", "")
    assert len(traj.turns) == 1 and traj.turns[0].action_is_valid  # its call, recorded
    assert traj.episode_return == 0.75 and traj.success
    m = traj.env_metrics
    assert m["exit_code"] == 0 and m["timed_out"] == 0 and 0 < m["first_call_s"] < m["wall_s"]


def test_a_hanging_harness_and_its_children_are_killed_at_its_timeout(
    tok: Any, tmp_path: Path
) -> None:
    start = time.monotonic()
    traj = play(tok, tmp_path, "hang", timeout_s=3)
    assert time.monotonic() - start < 30
    assert traj.env_metrics["timed_out"] == 1 and traj.episode_return == 0.75
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "roll-harness-marker"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "the harness's child outlived the episode"


def test_a_missing_command_is_the_recipes_error() -> None:
    program = load_agent("roll_core.envs.harness:run", {"command": ["no-such-harness-xyz"]})
    with pytest.raises(ConfigError, match="the command 'no-such-harness-xyz' does not exist"):
        program.task(0)
    program = load_agent("roll_core.envs.harness:run", {})
    with pytest.raises(ConfigError, match="needs options.command"):
        program.task(0)
    assert os.environ.get("OPENAI_BASE_URL") is None  # nothing leaked into roll's own process


FIXER = """
import os, subprocess, sys
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": os.environ["ROLL_TASK"]}])
if "fix" in sys.argv:  # a harness that solves the task: the reference fix, in its workspace
    subprocess.run(["git", "apply", os.environ["FIX_PATCH"]], check=True, cwd=os.environ["ROLL_WORKSPACE"])
"""


@pytest.mark.parametrize("solve", [True, False])
def test_a_swe_task_is_graded_on_the_harness_workspace(
    tok: Any, tmp_path: Path, solve: bool
) -> None:
    from roll_core.sandbox.local import namespaces_work
    from tests.swe.test_tasks import make_task as make_swe_task

    if not namespaces_work(sys.executable, True, 65534)[0]:
        pytest.skip("grading's sandbox needs user namespaces")
    task_dir = make_swe_task(tmp_path / "tasks")
    script = tmp_path / "fixer.py"
    script.write_text(textwrap.dedent(FIXER))
    options = {
        "command": [sys.executable, str(script), *(["fix"] if solve else [])],
        "tasks": str(tmp_path / "tasks"),
        "env": {"FIX_PATCH": str(task_dir / "fix.patch")},
    }
    spec = EnvSpec("swe", lambda: None, agent=load_agent("roll_core.envs.harness:run", options))
    mgr = EnvRolloutManager(infer=CalcInfer(tok), tokenizer=tok, specs=[spec], settings=settings())
    try:
        [traj] = mgr.run_episodes(spec, [0], SamplingParams(max_new_tokens=80))
    finally:
        mgr.close()
    assert traj.status == "done", traj.error
    assert (traj.episode_return, traj.success) == ((1.0, True) if solve else (0.0, False))
    assert traj.env_metrics["resolved"] == float(solve)
    assert (traj.env_metrics["diff_lines"] > 0) == solve
