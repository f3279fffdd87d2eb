"""A real agent harness, run as a command, as an agent program (issue 41's harness agents).

A recipe names it as its agent, with the command in the options::

    envs:
      - agent: roll_core.envs.harness:run
        options:
          command: ["mini", "-y", "-t", "$ROLL_TASK"]   # argv (or one shell string)
          tasks: data/swe/train                      # SWE task folders (roll data swe), or none
          python: /opt/mswe-venv/bin/python           # the harness's interpreter (its venv)
          timeout_s: 600

Each episode: a fresh sandbox (:mod:`roll_core.sandbox`) whose workspace is a copy of the
task's repository (or empty), and the command started **inside** it (``$ROLL_TASK`` in an
argument is replaced by the task's text): its working directory the workspace
(``/workspace``), its own network namespace, the sandbox's resource limits, nothing of the
host's file system but the system's directories, ``python``'s installation and ``read_only``
paths. Its one way out is a tunnel to the episode's endpoint session
(:mod:`roll_core.sandbox.tunnel`): ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` are
``http://127.0.0.1:<port>/s/<token>/v1`` on the sandbox's own loopback (``ANTHROPIC_BASE_URL``
the same without ``/v1``; ``*_API_KEY`` set), relayed to the endpoint and nowhere else; every
other host port and the network stay out of reach. The task is in ``ROLL_TASK`` (the issue
text), the workspace in ``ROLL_WORKSPACE``. At its end, its timeout or the episode's, every
process of the sandbox is killed (nothing is left behind); when roll ends the episode first
(its group finished, the episode's deadline), the harness is stopped within a second too (its
session then answers 404, which a watcher polls).

``isolation``: ``required`` (default) runs the harness in the sandbox or fails where
namespaces do not work (before the run exists: the task of seed 0 is made during the run's
checks); ``preferred`` falls back, with a warning, to ``none`` there; ``none`` runs the
harness as a plain process group on the host (the user running roll, a workspace folder under
the system's temporary directory, the endpoint on the host's loopback, roll's environment):
for harnesses that need the network. Grading is sandboxed in every case.

The reward: a SWE task's grade (the workspace's diff against the repository, applied to a
fresh copy in another sandbox, the hidden tests run there: :func:`roll_core.swe.grading.grade`);
without tasks, the number the harness wrote to ``$ROLL_REWARD_FILE`` (0 when it wrote none).
The episode's own metrics (``rollout/env/<name>``): ``exit_code``, ``timed_out``, ``wall_s``,
``sandbox_s`` (creating the sandbox), ``model_connections`` (connections through the way out;
sandboxed only), ``diff_lines`` and, for SWE tasks, ``resolved`` and ``grade_s``; the endpoint
adds ``first_call_s`` (the harness's start-up). A sandboxed harness that never reached the
endpoint (a crash at start, a wrong base URL) is an episode fault whose text names the
command, its exit code and the tail of its output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from roll_core.errors import ConfigError, SandboxError
from roll_core.sandbox.host import kill_group

log = logging.getLogger(__name__)

_TASKS: dict[tuple[str, str], list[Any]] = {}  # (folder, split) -> tasks (loaded once)
_BACKENDS: dict[str, Any] = {}  # "grade" / "harness" -> one LocalBackend each (their slots)
_LOCK = threading.Lock()
REWARD_INSIDE = ".roll-reward"  # in the workspace (its /tmp ends with the command)
HARNESS_SLOTS = 256  # harnesses mostly wait for the model: they are not bounded by CPUs
TAIL = 1500  # characters of a failed harness's output in its fault text


def make_task(
    seed: int,
    command: list[str] | str = "",
    tasks: str | None = None,
    split: str = "train",
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    prompt: str = "",
    isolation: Literal["required", "preferred", "none"] = "required",
    python: str | None = None,
    read_only: list[str] | None = None,
    port: int = 18080,
    memory_mb: int = 4096,
    max_processes: int = 128,
) -> dict[str, Any]:
    """The episode's task: the command, where it runs, and the SWE task of ``seed`` (seed
    modulo the number of tasks of ``split`` in ``tasks``), or ``prompt`` as the task text.
    ``python``: the interpreter shown inside the sandbox with its virtualenv (default: roll's);
    ``read_only``: more host paths shown read-only; ``port``: the endpoint's port inside."""
    argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
    if not argv:
        raise ConfigError(
            "agent roll_core.envs.harness:run needs options.command: the harness to start "
            "each episode (e.g. [python, my_harness.py]).",
            hint="Set envs[].options.command (docs/swe.md, 'Harness agents').",
        )
    if isolation not in ("required", "preferred", "none"):
        raise ConfigError(
            f"agent roll_core.envs.harness:run: options.isolation={isolation!r}; it is one of "
            "required, preferred, none.",
            hint="docs/swe.md, 'Harness agents'.",
        )
    interpreter = _interpreter(python)
    mode = _mode(isolation, interpreter)
    shown = [str(Path(p).resolve()) for p in read_only or []]
    _check_command(argv[0], mode, interpreter, shown)
    task: dict[str, Any] = {"seed": seed, "argv": argv, "timeout_s": float(timeout_s)}
    task |= {"env": dict(env or {}), "text": prompt, "swe": None, "mode": mode}
    task |= {"python": interpreter, "read_only": shown, "port": int(port)}
    task |= {"memory_mb": int(memory_mb), "max_processes": int(max_processes)}
    if tasks is not None:
        swe = _tasks(tasks, split)
        chosen = swe[seed % len(swe)]
        task |= {"swe": chosen, "text": chosen.problem_statement, "task_id": chosen.task_id}
    return task


def _interpreter(python: str | None) -> str:
    if python is None:
        return sys.executable
    found = shutil.which(python)
    if found is None:
        raise ConfigError(
            f"agent roll_core.envs.harness:run: options.python={python!r} is not an "
            "interpreter (not a file, not on PATH).",
            hint="Point it at the python of the harness's virtualenv (e.g. "
            "/opt/mswe-venv/bin/python), or leave it out to use roll's.",
        )
    # its folder resolved (the sandbox shows real paths), not the file itself: a venv's
    # python is a link to its base interpreter, and the venv is what must be shown
    return os.path.join(os.path.realpath(os.path.dirname(found)), os.path.basename(found))


def _mode(isolation: str, python: str) -> str:
    """``sandbox`` or ``host``: where the harness runs (see the module docstring)."""
    if isolation == "none":
        return "host"
    from roll_core.sandbox.local import namespaces_work

    ok, why = namespaces_work(python, True, 65534)
    if ok:
        return "sandbox"
    if isolation == "required":
        raise SandboxError(
            "agent roll_core.envs.harness:run: the harness runs in a sandbox (isolation: "
            f"required) but namespaces do not work on this machine: {why}",
            hint="Make unprivileged user namespaces work (docs/swe.md, 'The sandbox'), or set "
            "envs[].options.isolation: preferred (fall back to a plain process) or none.",
        )
    _warn_once(
        f"harness: namespaces unavailable ({why}); the harness runs as a plain process on the "
        "host (isolation: preferred), with the network and roll's environment"
    )
    return "host"


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def _check_command(program: str, mode: str, python: str, shown: list[str]) -> None:
    """A ConfigError when ``program`` cannot start where the harness runs."""
    found: str | None
    if mode == "host":
        found = shutil.which(program) or (program if Path(program).exists() else None)
        where = "not a file, not on PATH"
    else:
        from roll_core.sandbox.host import ENV, interpreter_paths

        path = f"{os.path.dirname(python)}:{ENV['PATH']}"
        found = shutil.which(program, path=path) if "/" not in program else program
        _, binds, _ = interpreter_paths(python, True)
        visible = [*binds, *shown, "/workspace"]
        real = os.path.realpath(found) if found else ""
        if found and not any(real == b or real.startswith(b.rstrip("/") + "/") for b in visible):
            found = None
        if found and not str(found).startswith("/workspace") and not os.path.exists(found):
            found = None
        where = (
            f"not on the sandbox's PATH ({path}) nor a file the sandbox shows (the system's "
            "directories, the interpreter's installation, options.read_only, /workspace)"
        )
    if not found:
        raise ConfigError(
            f"agent roll_core.envs.harness:run: the command {program!r} does not exist ({where}).",
            hint="Fix envs[].options.command, install the harness in options.python's "
            "virtualenv, or show its folder with options.read_only.",
        )


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


def _backend(kind: str) -> Any:
    from roll_core.sandbox.local import LocalBackend

    with _LOCK:
        if kind not in _BACKENDS:
            _BACKENDS[kind] = LocalBackend(
                max_concurrent=HARNESS_SLOTS if kind == "harness" else None
            )
        return _BACKENDS[kind]


def _variables(base: str, task: dict[str, Any], workspace: str, reward: str) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": base,
        "OPENAI_API_BASE": base,  # older clients and litellm's name for it
        "OPENAI_API_KEY": "roll",
        "ANTHROPIC_BASE_URL": base.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": "roll",
        "ROLL_TASK": str(task["text"]),
        "ROLL_WORKSPACE": workspace,
        "ROLL_REWARD_FILE": reward,
        **task["env"],
    }


def run(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One episode of the harness (see the module docstring)."""
    limit = min(float(task["timeout_s"]), _client_timeout(client))
    if task["mode"] == "sandbox":
        return _run_sandboxed(client, task, limit)
    return _run_on_host(client, task, limit)


class _SessionWatch:
    """Stops the harness when roll ends its episode first (its group finished, a fault, the
    episode's deadline): the episode's session then answers 404, checked every ``every``
    seconds with ``GET .../models`` on the host side."""

    def __init__(self, client: Any, stop: Any, every: float = 1.0) -> None:
        self.url = str(client.base_url).rstrip("/") + "/models"
        self.stop = stop
        self.every = every
        self.ended = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="harness-watch", daemon=True)

    def __enter__(self) -> _SessionWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=10)

    def _watch(self) -> None:
        import urllib.error
        import urllib.request

        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
        while not self.done.wait(self.every):
            try:
                direct.open(self.url, timeout=10).close()
            except urllib.error.HTTPError as err:
                if err.code == 404:  # the session is closed: the episode is over
                    self.ended = True
                    self.stop()
                    return
            except OSError:
                continue  # the endpoint is busy or restarting: look again

    def check(self) -> None:
        if self.ended:
            raise RuntimeError(
                "the episode ended (cancelled, timed out or failed) while the harness ran; "
                "its processes were killed"
            )


def _run_sandboxed(client: Any, task: dict[str, Any], limit: float) -> dict[str, Any]:
    from roll_core.sandbox import SandboxSpec
    from roll_core.sandbox.base import Tunnel

    swe = task["swe"]
    start = time.perf_counter()
    empty = None
    if swe is None:
        empty = Path(tempfile.mkdtemp(prefix="roll-harness-"))
    spec = SandboxSpec(
        python=task["python"],
        read_only=tuple(task["read_only"]),
        memory_mb=task["memory_mb"],
        cpu_s=max(1, int(limit) + 1),
        max_processes=task["max_processes"],
        max_output_bytes=1 << 16,
    )
    try:
        box = _backend("harness").create(swe.repo_dir if swe else empty, spec)
    finally:
        if empty is not None:
            shutil.rmtree(empty, ignore_errors=True)
    metrics = {"sandbox_s": time.perf_counter() - start}
    try:
        url = urlsplit(str(client.base_url))
        inside = urlunsplit(url._replace(netloc=f"127.0.0.1:{task['port']}")).rstrip("/")
        tunnel = Tunnel(task["port"], (url.hostname or "127.0.0.1", int(url.port or 80)))
        variables = _variables(inside, task, box.workdir, f"{box.workdir}/{REWARD_INSIDE}")
        command = shlex.join(_argv(task))
        started = time.perf_counter()
        with _SessionWatch(client, box.close) as watch:
            result = box.exec(command, limit, env=variables, tunnel=tunnel)
        watch.check()
        metrics["wall_s"] = time.perf_counter() - started
        metrics["exit_code"] = float(result.exit_code)
        metrics["timed_out"] = float(result.timed_out)
        metrics["model_connections"] = float(box.relay.connections if box.relay else 0)
        if not metrics["model_connections"]:
            out = result.output().strip()[-TAIL:] or "no output"
            raise RuntimeError(
                f"the harness command {command!r} "
                + ("timed out" if result.timed_out else f"exited with code {result.exit_code}")
                + f" without calling the model (no connection to its endpoint); its output "
                f"ends:\n{out}"
            )
        if swe is None:
            text = ""
            with contextlib.suppress(ValueError):
                text = box.read_file(REWARD_INSIDE)
            return _reward_from_file(text, metrics)
        diff = box.diff()
    finally:
        box.close()
    return _graded(swe, diff, metrics)


def _run_on_host(client: Any, task: dict[str, Any], limit: float) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="roll-harness-"))
    workspace = scratch / "workspace"
    swe = task["swe"]
    if swe is not None:
        shutil.copytree(swe.repo_dir, workspace, symlinks=True)
    else:
        workspace.mkdir()
    reward_file = scratch / "reward"
    start = time.perf_counter()
    env = {**os.environ, **_variables(str(client.base_url).rstrip("/"), task, str(workspace),
                                      str(reward_file))}  # fmt: skip
    log_file = (scratch / "harness.log").open("wb")
    try:
        proc = subprocess.Popen(
            _argv(task),
            cwd=workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole at the end
        )
        try:
            with _SessionWatch(client, lambda: _kill_group(proc, wait=False)) as watch:
                code, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            code, timed_out = -int(signal.SIGKILL), True
        finally:
            _kill_group(proc)
        watch.check()
        metrics = {"exit_code": float(code), "timed_out": float(timed_out)}
        metrics["wall_s"] = time.perf_counter() - start
        if swe is None:
            text = reward_file.read_text() if reward_file.exists() else ""
            return _reward_from_file(text, metrics)
        from roll_core.sandbox.diff import diff_trees

        diff = diff_trees(swe.repo_dir, workspace).text
        return _graded(swe, diff, metrics)
    finally:
        log_file.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _argv(task: dict[str, Any]) -> list[str]:
    return [a.replace("$ROLL_TASK", str(task["text"])) for a in task["argv"]]


def _client_timeout(client: Any) -> float:
    """The episode's time left, as roll gave the client its timeout."""
    timeout = getattr(client, "timeout", None)
    value = getattr(timeout, "read", timeout)
    return float(value) if isinstance(value, (int, float)) else float("inf")


def _kill_group(proc: subprocess.Popen[bytes], wait: bool = True) -> None:
    """SIGKILL the harness's process group (everything it started that stayed in it); with
    `wait`, return once all of it is gone."""
    if wait:
        kill_group(proc)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _reward_from_file(text: str, metrics: dict[str, float]) -> dict[str, Any]:
    text = text.strip()
    try:
        reward = float(text) if text else 0.0
    except ValueError:
        raise ValueError(
            f"the harness wrote {text[:80]!r} to $ROLL_REWARD_FILE: not a number"
        ) from None
    return {"reward": reward, "success": reward > 0, "metrics": metrics}


def _graded(swe: Any, diff: str, metrics: dict[str, float]) -> dict[str, Any]:
    from roll_core.swe.grading import grade

    metrics["diff_lines"] = float(
        sum(line[:1] in "+-" and line[:3] not in ("+++", "---") for line in diff.splitlines())
    )
    result = grade(swe, diff, backend=_backend("grade"))
    metrics["resolved"] = float(result.resolved)
    metrics["grade_s"] = result.seconds
    return {"reward": result.score, "success": result.resolved, "metrics": metrics}
