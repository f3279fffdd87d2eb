"""The coding env: tools, budgets, truncation notes, grading as reward, metrics, the CLI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roll_core.envs import make_env
from roll_core.envs.tools import tool_call_text
from roll_core.sandbox.local import namespaces_work
from tests.swe.test_tasks import make_task

pytestmark = pytest.mark.skipif(
    not namespaces_work(sys.executable, True, 65534)[0],
    reason="the local sandbox needs user namespaces",
)


def call(name: str, **arguments) -> str:
    return tool_call_text(name, arguments)


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    make_task(tmp_path / "tasks")
    return tmp_path / "tasks"


def test_the_expert_solves_a_task_through_tool_calls(tasks: Path) -> None:
    env = make_env("swe", tasks=str(tasks))
    obs, info = env.reset(0)
    assert info["task_id"] == "calc-1" and "add(2, 3) gives -1" in obs
    first = env.step(env.expert_action())
    assert first.info["tool_ok"] and not first.terminated
    assert env.expert_action() == call("submit")
    last = env.step(env.expert_action())
    assert last.terminated and last.reward == 1.0 and last.info["success"]
    metrics = last.info["episode_metrics"]
    assert metrics["solved"] == 1.0 and metrics["diff_lines"] == 2 and metrics["steps"] == 2
    assert metrics["f2p_passed"] == 2 and metrics["p2p_passed"] == 1


def test_tools_errors_truncation_and_the_step_budget(tasks: Path) -> None:
    env = make_env("swe", tasks=str(tasks), max_steps=5, max_output_chars=200,
                   command_timeout_s=1)  # fmt: skip
    env.reset(0)
    r = env.step(call("editor", command="view", path="calc.py", view_range=[1, 2]))
    assert (
        r.observation.tool_results[0].content == "     1\tdef add(a, b):\n     2\t    return a - b"
    )
    r = env.step(call("editor", command="str_replace", path="calc.py", old_str="a", new_str="b"))
    assert not r.info["tool_ok"] and "occurs 5 times" in r.observation
    r = env.step("I think the bug is in add.")  # no tool call
    assert not r.info["action_is_valid"] and r.reward == -0.1
    r = env.step(call("bash", command="seq 1 1000; sleep 5"))
    content = r.observation.tool_results[0].content
    assert content.startswith("[timed out]\n1\n2\n") and "[output truncated: " in content
    r = env.step(call("bash", command="sed -i 's/a - b/a + b/' calc.py"))  # the 5th step
    assert r.truncated and not r.terminated and r.reward == 1.0  # graded on truncation
    m = r.info["episode_metrics"]
    assert m["tool_errors"] == 1 and m["timeouts"] == 1 and m["solved"] == 1.0


def test_editing_the_tests_does_not_pass(tasks: Path) -> None:
    env = make_env("swe", tasks=str(tasks))
    env.reset(0)
    env.step(call("editor", command="create", path="conftest.py", file_text="import sys\n"))
    r = env.step(call("submit"))
    assert r.terminated and r.reward == 0.0 and "conftest.py" in r.observation


def test_bad_options_are_named(tasks: Path) -> None:
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match="no test tasks"):
        make_env("swe", tasks=str(tasks), split="test")


@pytest.mark.slow
def test_roll_debug_env_swe_with_the_expert(roll, tasks: Path) -> None:
    result = roll("debug-env", "swe", f"tasks={tasks}", "--policy", "expert")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Submitted: solved (score 1)." in out and "success rate 100%" in out


def test_the_time_budget_truncates_and_grades(tasks: Path) -> None:
    env = make_env("swe", tasks=str(tasks), time_budget_s=0.001)
    env.reset(0)
    r = env.step(call("bash", command="true"))
    assert r.truncated and "Out of time" in r.observation and r.reward == 0.0


@pytest.mark.slow
def test_eight_episodes_at_once_on_two_slots_lose_nothing(tasks: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def episode(seed: int) -> float:
        env = make_env("swe", tasks=str(tasks), sandbox_slots=2)
        env.reset(seed)
        while True:
            r = env.step(env.expert_action())
            if r.terminated or r.truncated:
                return r.reward

    with ThreadPoolExecutor(max_workers=8) as pool:
        rewards = list(pool.map(episode, range(8)))
    assert rewards == [1.0] * 8
