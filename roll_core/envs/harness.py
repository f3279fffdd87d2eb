"""A real agent harness, run as a command, as an agent program (issue 41's harness agents).

A recipe names it as its agent, with the command in the options::

    envs:
      - agent: roll_core.envs.harness:run
        options:
          command: ["python", "my_harness.py"]     # argv (or one shell string)
          tasks: data/swe/train                   # SWE task folders (roll data swe), or none
          timeout_s: 600

Each episode: a fresh workspace (a copy of the task's repository, or an empty folder), the
command started there in its own process group with the episode's endpoint in the standard
variables (``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` with ``/v1``, ``ANTHROPIC_BASE_URL``
without, ``*_API_KEY``), the task in ``ROLL_TASK`` (the issue text) and ``ROLL_WORKSPACE``; at its
end, its timeout, or the episode's, the whole process group is killed (nothing is left
behind). The reward: a SWE task's grade (the workspace's diff against the repository, applied to
a fresh copy in a sandbox, the hidden tests run there: :func:`roll_core.swe.grading.grade`);
without tasks, the number the harness wrote to ``$ROLL_REWARD_FILE`` (0 when it wrote none).
The episode's own metrics (``rollout/env/<name>``): ``exit_code``, ``timed_out``, ``wall_s``,
``diff_lines`` and, for SWE tasks, ``resolved``; the endpoint adds ``first_call_s`` (the
harness's start-up).

The harness runs as the user running roll, in the workspace folder: it is not sandboxed (the
sandbox of :mod:`roll_core.sandbox` has no network, so a harness inside it cannot reach the
endpoint yet). Grading is sandboxed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

_TASKS: dict[tuple[str, str], list[Any]] = {}  # (folder, split) -> tasks (loaded once)
_GRADER: list[Any] = []  # one sandbox backend for every episode's grading (its CPU slots)


def make_task(
    seed: int,
    command: list[str] | str = "",
    tasks: str | None = None,
    split: str = "train",
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    prompt: str = "",
) -> dict[str, Any]:
    """The episode's task: the command, and the SWE task of ``seed`` (seed modulo the number
    of tasks of ``split`` in ``tasks``), or ``prompt`` as the task text."""
    argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if not argv:
        raise ConfigError(
            "agent roll_core.envs.harness:run needs options.command: the harness to start "
            "each episode (e.g. [python, my_harness.py]).",
            hint="Set envs[].options.command (docs/swe.md, 'Harness agents').",
        )
    if shutil.which(argv[0]) is None and not Path(argv[0]).exists():
        raise ConfigError(
            f"agent roll_core.envs.harness:run: the command {argv[0]!r} does not exist (not a "
            "file, not on PATH).",
            hint="Fix envs[].options.command, or install the harness.",
        )
    task: dict[str, Any] = {"seed": seed, "argv": argv, "timeout_s": float(timeout_s)}
    task |= {"env": dict(env or {}), "text": prompt, "swe": None}
    if tasks is not None:
        swe = _tasks(tasks, split)
        chosen = swe[seed % len(swe)]
        task |= {"swe": chosen, "text": chosen.problem_statement, "task_id": chosen.task_id}
    return task


def _tasks(folder: str, split: str) -> list[Any]:
    from roll_core.swe.task import load_tasks

    key = (str(Path(folder).resolve()), split)
    if key not in _TASKS:
        found = load_tasks(Path(folder), split=split)
        if not found:
            raise ConfigError(
                f"agent roll_core.envs.harness:run: no {split} tasks in {folder}.",
                hint="Generate them with `roll data swe OUT_DIR`, or point options.tasks at "
                "a folder of task folders (docs/swe.md).",
            )
        _TASKS[key] = found
    return _TASKS[key]


def _environment(client: Any, task: dict[str, Any], workspace: Path, reward: Path) -> dict:
    base = str(client.base_url).rstrip("/")
    return {
        **os.environ,
        "OPENAI_BASE_URL": base,
        "OPENAI_API_BASE": base,  # older clients and litellm's name for it
        "OPENAI_API_KEY": "roll",
        "ANTHROPIC_BASE_URL": base.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": "roll",
        "ROLL_TASK": str(task["text"]),
        "ROLL_WORKSPACE": str(workspace),
        "ROLL_REWARD_FILE": str(reward),
        **task["env"],
    }


def run(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One episode of the harness (see the module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="roll-harness-"))
    workspace = scratch / "workspace"
    swe = task["swe"]
    if swe is not None:
        shutil.copytree(swe.repo_dir, workspace, symlinks=True)
    else:
        workspace.mkdir()
    reward_file = scratch / "reward"
    limit = min(float(task["timeout_s"]), _client_timeout(client))
    start = time.perf_counter()
    log = (scratch / "harness.log").open("wb")
    try:
        proc = subprocess.Popen(
            task["argv"],
            cwd=workspace,
            env=_environment(client, task, workspace, reward_file),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole at the end
        )
        try:
            code, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            code, timed_out = -int(signal.SIGKILL), True
        finally:
            _kill_group(proc)
        metrics = {"exit_code": float(code), "timed_out": float(timed_out)}
        metrics["wall_s"] = time.perf_counter() - start
        return _outcome(task, swe, workspace, reward_file, metrics)
    finally:
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _client_timeout(client: Any) -> float:
    """The episode's time left, as roll gave the client its timeout."""
    timeout = getattr(client, "timeout", None)
    value = getattr(timeout, "read", timeout)
    return float(value) if isinstance(value, (int, float)) else float("inf")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the harness's process group (everything it started that stayed in it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _outcome(
    task: dict[str, Any], swe: Any, workspace: Path, reward_file: Path, metrics: dict[str, float]
) -> dict[str, Any]:
    if swe is None:
        text = reward_file.read_text().strip() if reward_file.exists() else ""
        try:
            reward = float(text) if text else 0.0
        except ValueError:
            raise ValueError(
                f"the harness wrote {text[:80]!r} to $ROLL_REWARD_FILE: not a number"
            ) from None
        return {"reward": reward, "success": reward > 0, "metrics": metrics}
    from roll_core.sandbox.diff import diff_trees
    from roll_core.sandbox.local import LocalBackend
    from roll_core.swe.grading import grade

    diff = diff_trees(swe.repo_dir, workspace).text
    metrics["diff_lines"] = float(len(diff.splitlines()))
    if not _GRADER:
        _GRADER.append(LocalBackend())
    result = grade(swe, diff, backend=_GRADER[0])
    metrics["resolved"] = float(result.resolved)
    return {"reward": result.score, "success": result.resolved, "metrics": metrics}
