"""A real harness as a command (roll_core/envs/harness.py), through the rollout manager with
the scripted calculator model of tests/rollout/test_agent_endpoint.py: the command runs inside
its sandbox and gets the episode's endpoint (through the sandbox's one way out) in the standard
variables, its model calls are the trajectory, its reward and metrics come back, and everything
it started is killed at its timeout. The same on the host with isolation: none."""

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
from roll_core.rollout.agentic import EnvSpec, env_producer, run_episodes
from roll_core.sandbox.local import namespaces_work
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


NS_OK = namespaces_work(sys.executable, True, 65534)[0]
ISOLATIONS = [
    pytest.param("required", marks=pytest.mark.skipif(not NS_OK, reason="no user namespaces")),
    "none",
]


def shown(tmp_path: Path) -> list[str]:
    """tmp_path, readable by the sandbox's uid (pytest makes it 0700), shown read-only."""
    tmp_path.chmod(0o755)
    return [str(tmp_path)]


def play(
    tok: Any, tmp_path: Path, *extra: str, timeout_s: float = 60, isolation: str = "required"
) -> Any:
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(HARNESS))
    options: dict[str, Any] = {"command": [sys.executable, str(script), *extra]}
    options |= {"prompt": "12*34", "isolation": isolation, "read_only": shown(tmp_path)}
    options["timeout_s"] = timeout_s
    spec = EnvSpec("harness", lambda: None, agent=load_agent("roll_core.envs.harness:run", options))
    mgr = env_producer(infer=CalcInfer(tok), tokenizer=tok, specs=[spec], settings=settings())
    try:
        [traj] = run_episodes(mgr, spec, [0], SamplingParams(max_new_tokens=80))
        return traj
    finally:
        mgr.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_command_harness_is_an_agent_episode(tok: Any, tmp_path: Path, isolation: str) -> None:
    traj = play(tok, tmp_path, isolation=isolation)
    assert (traj.status, traj.error) == ("done", ""), traj.error
    assert len(traj.turns) == 1 and traj.turns[0].action_is_valid  # its call, recorded
    assert traj.episode_return == 0.75 and traj.success
    m = traj.env_metrics
    assert m["exit_code"] == 0 and m["timed_out"] == 0 and m["first_call_s"] > 0
    if isolation == "required":
        assert m["model_connections"] >= 1 and m["sandbox_s"] > 0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_hanging_harness_and_its_children_are_killed_at_its_timeout(
    tok: Any, tmp_path: Path, isolation: str
) -> None:
    start = time.monotonic()
    traj = play(tok, tmp_path, "hang", timeout_s=8, isolation=isolation)
    assert time.monotonic() - start < 40
    assert traj.status == "done", traj.error
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
    from tests.swe.test_tasks import make_task as make_swe_task

    if not NS_OK:
        pytest.skip("the harness's and grading's sandboxes need user namespaces")
    task_dir = make_swe_task(tmp_path / "tasks")
    harness = (
        tmp_path / "harness"
    )  # what the sandbox shows: the script and (a test's cheat) the fix
    harness.mkdir()
    (harness / "fixer.py").write_text(textwrap.dedent(FIXER))
    (harness / "fix.patch").write_text((task_dir / "fix.patch").read_text())
    options = {
        "command": [sys.executable, str(harness / "fixer.py"), *(["fix"] if solve else [])],
        "tasks": str(tmp_path / "tasks"),
        "env": {"FIX_PATCH": str(harness / "fix.patch")},
        "read_only": shown(harness),
    }
    traj = play_options(tok, options)
    assert traj.status == "done", traj.error
    assert (traj.episode_return, traj.success) == ((1.0, True) if solve else (0.0, False))
    assert traj.env_metrics["resolved"] == float(solve)
    assert (traj.env_metrics["diff_lines"] > 0) == solve
    assert traj.env_metrics["grade_s"] > 0 and traj.env_metrics["sandbox_s"] > 0


def play_options(tok: Any, options: dict[str, Any], **kw: Any) -> Any:
    spec = EnvSpec("swe", lambda: None, agent=load_agent("roll_core.envs.harness:run", options))
    mgr = env_producer(infer=CalcInfer(tok), tokenizer=tok, specs=[spec], settings=settings(**kw))
    try:
        [traj] = run_episodes(mgr, spec, [0], SamplingParams(max_new_tokens=80))
        return traj
    finally:
        mgr.close()


SNOOP = """
import os, socket, sys
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
seen = []
for port in map(int, sys.argv[1:]):  # the endpoint's host port, another host port
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2)
        seen.append(f"port {port}")
    except OSError:
        pass
for path in (os.environ["SECRET_FILE"], os.environ["SECRET_DIR"]):  # beside the shown folder
    if os.path.exists(path):
        seen.append(path)
open(os.environ["ROLL_REWARD_FILE"], "w").write("0" if seen else "1")
print("SEEN", seen)
"""


@pytest.mark.skipif(not NS_OK, reason="no user namespaces")
def test_a_sandboxed_harness_reaches_its_endpoint_and_nothing_else(
    tok: Any, tmp_path: Path
) -> None:
    import socket

    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "snoop.py").write_text(textwrap.dedent(SNOOP))
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    (tmp_path / "tasks").mkdir()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(1)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    endpoint_port = free.getsockname()[1]
    free.close()
    with other:
        ports = [str(other.getsockname()[1]), str(endpoint_port)]  # both listen on the host
        options = {
            "command": [sys.executable, str(harness / "snoop.py"), *ports],
            "prompt": "look around",
            "env": {"SECRET_FILE": str(secret), "SECRET_DIR": str(tmp_path / "tasks")},
            "read_only": shown(harness),
        }
        traj = play_options(tok, options, endpoint_port=endpoint_port)
    assert traj.status == "done", traj.error
    assert traj.env_metrics["model_connections"] == 1
    assert traj.episode_return == 1.0  # its model call went through; nothing else was seen


@pytest.mark.skipif(not NS_OK, reason="no user namespaces")
def test_a_harness_that_exits_at_once_is_a_fault_naming_it(tok: Any, tmp_path: Path) -> None:
    options = {"command": ["bash", "-c", "echo cannot start: no config >&2; exit 3"]}
    traj = play_options(tok, {**options, "prompt": "x"})
    assert traj.status != "done"
    assert "exited with code 3 without calling the model" in traj.error
    assert "cannot start: no config" in traj.error and "bash -c" in traj.error


def test_a_command_the_sandbox_cannot_see_is_the_recipes_error(tmp_path: Path) -> None:
    script = tmp_path / "harness.py"
    script.write_text("print(1)\n")
    options = {"command": ["no-such-harness-xyz"], "isolation": "none"}
    with pytest.raises(ConfigError, match="'no-such-harness-xyz' does not exist"):
        load_agent("roll_core.envs.harness:run", options).task(0)
    if NS_OK:  # on the host, not in the sandbox (nor shown with read_only)
        options = {"command": [str(script)], "isolation": "required"}
        with pytest.raises(ConfigError, match="not on the sandbox's PATH"):
            load_agent("roll_core.envs.harness:run", options).task(0)
    with pytest.raises(ConfigError, match="isolation='maybe'"):
        load_agent("roll_core.envs.harness:run", {"command": "x", "isolation": "maybe"}).task(0)


@pytest.mark.slow
@pytest.mark.skipif(not NS_OK, reason="no user namespaces")
def test_eight_sandboxed_harness_episodes_at_once_lose_nothing(tok: Any, tmp_path: Path) -> None:
    """8 harnesses at once, each in its own sandbox with its own way out, graded on 2 CPU slots
    (the grading backend's default on this 2-core machine): every episode ends done and
    solved. Prints the per-episode times (docs/swe.md, 'Cost')."""
    from tests.swe.test_tasks import make_task as make_swe_task

    task_dir = make_swe_task(tmp_path / "tasks")
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "fixer.py").write_text(textwrap.dedent(FIXER))
    (harness / "fix.patch").write_text((task_dir / "fix.patch").read_text())
    options = {
        "command": [sys.executable, str(harness / "fixer.py"), "fix"],
        "tasks": str(tmp_path / "tasks"),
        "env": {"FIX_PATCH": str(harness / "fix.patch")},
        "read_only": shown(harness),
    }
    spec = EnvSpec("swe", lambda: None, agent=load_agent("roll_core.envs.harness:run", options))
    mgr = env_producer(
        infer=CalcInfer(tok),
        tokenizer=tok,
        specs=[spec],
        settings=settings(episode_timeout_s=300, step_timeout_s=120),
    )
    start = time.monotonic()
    try:
        trajs = run_episodes(mgr, spec, list(range(8)), SamplingParams(max_new_tokens=80))
    finally:
        mgr.close()
    wall = time.monotonic() - start
    assert [t.status for t in trajs] == ["done"] * 8, [t.error for t in trajs]
    assert [t.episode_return for t in trajs] == [1.0] * 8
    for key in ("sandbox_s", "first_call_s", "wall_s", "grade_s"):
        values = [t.env_metrics[key] for t in trajs]
        print(f"{key}: mean {sum(values) / 8:.3f} max {max(values):.3f}")
    print(f"8 episodes: {wall:.1f} s wall; load {os.getloadavg()[0]:.1f}")


def test_the_harness_is_stopped_when_its_session_ends(tok: Any) -> None:
    """roll ended the episode first (its group finished, a fault): the session is closed,
    so the watcher stops the harness; while the session is open it does nothing."""
    import threading
    from types import SimpleNamespace

    from roll_core.envs.harness import _SessionWatch
    from roll_core.rollout.agentic.endpoint import AgentEndpoint
    from tests.rollout.test_agent_endpoint import session

    endpoint = AgentEndpoint(port=0)
    try:
        s, client = session(tok, endpoint)
        stopped = threading.Event()
        with _SessionWatch(SimpleNamespace(base_url=client.base_url), stopped.set, 0.2) as w:
            time.sleep(1.0)
            assert not stopped.is_set()  # open: a 200 each time
            endpoint.close_session(s)
            assert stopped.wait(5)
        with pytest.raises(RuntimeError, match="the episode ended"):
            w.check()
    finally:
        endpoint.close()


def test_where_namespaces_do_not_work(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """isolation required: the recipe's error before the run, saying why and what to set;
    preferred: a warning and the harness on the host; none: the host, no probe."""
    import roll_core.sandbox.local as local
    from roll_core.envs import harness
    from roll_core.errors import SandboxError

    monkeypatch.setattr(local, "namespaces_work", lambda *a: (False, "unshare failed: EPERM"))
    with pytest.raises(SandboxError, match="unshare failed: EPERM") as err:
        harness._mode("required", sys.executable)
    assert "isolation: preferred" in (err.value.hint or "")
    with caplog.at_level("WARNING"):
        assert harness._mode("preferred", sys.executable) == "host"
    assert "runs as a plain process on the host" in caplog.text
    monkeypatch.setattr(local, "namespaces_work", lambda *a: pytest.fail("probed"))
    assert harness._mode("none", sys.executable) == "host"
