"""Running untrusted programs against test cases: limits, isolation, a bounded pool.

One call of :meth:`Sandbox.run` is one *execution*: a program and its test cases go to a
fresh supervisor process (:mod:`roll_core.rewards._sandbox_supervisor`, on the namespace and
confinement code it shares with the SWE sandbox in :mod:`roll_core.sandbox`) that runs each case
in a fresh interpreter and returns one verdict per case. The host side here:

* starts the supervisor in its own session with an empty environment (only ``PATH``,
  ``HOME``/``TMPDIR`` = the work directory, ``LANG`` and single-thread settings for
  BLAS/OpenMP) and sends it the spec (the program, each case's input and expected output,
  a fresh nonce) down its stdin pipe; no spec or result file exists anywhere;
* reads the verdict from its stdout pipe and keeps it only when the supervisor exited 0 and
  wrote exactly one line carrying the nonce: a supervisor that died, was killed, or whose
  output was tampered with gives ``sandbox_error`` on every case (never a kept pass);
* bounds the whole execution by the sum of the case timeouts plus ``startup_s``, then kills
  the process group;
* limits how many executions run at once (``max_concurrent``; callers block for a slot).

The supervisor makes itself non-dumpable before it reads the spec, so the expected outputs
live only in a memory no program can read (``/proc/<pid>/mem``, ``ptrace`` and
``process_vm_readv`` all need ``CAP_SYS_PTRACE`` over it); it compares the output after the
program has exited.

Isolation modes (``mode``):

``namespaces``
    User, mount, network, PID, IPC and UTS namespaces, created by the supervisor itself
    (``unshare(2)``; no ``bwrap`` install needed), and ``pivot_root`` into a new root that
    holds only the system's library directories and the interpreter's installation
    (read-only), a fresh ``/proc`` of the sandbox's own PID namespace, ``/dev/{null,zero,
    full,random,urandom}``, and a ``work_dir_mb`` tmpfs at ``/tmp`` (the work directory).
    No network (not even the host's ``localhost``), no host UNIX socket (path or
    abstract), no host ``/tmp``, home or other sample's files; only the sandbox's own
    processes are visible and signalable, and all of them die when the case ends; the
    program holds no capability.
``rlimits``
    For hosts without user namespaces (e.g. Docker's default seccomp profile). The program
    runs as the caller's uid (``run_as_uid`` when roll runs as root) under a seccomp filter
    (no new process, no signal to another process, no ``socket``, no ``ptrace``) and,
    where the kernel has Landlock, a file-system ruleset (read the interpreter and the
    system libraries, write the work directory, nothing else: no ``/proc``, no ``/tmp``).
    Without Landlock the program can read whatever its uid can read. See docs/rewards.md
    for what this mode does not protect.
``auto`` (default)
    ``namespaces`` when a probe execution shows they work, else ``rlimits`` with a warning.

Both modes set, per case and per process: address space (``memory_mb``), CPU seconds
(timeout + 2), file size (``max_file_mb``), open files (64), no core dumps; ``namespaces``
also ``max_processes`` (``RLIMIT_NPROC``, counted inside the sandbox's user namespace, so
never against the driver's threads). Output beyond ``max_output_bytes`` kills the program
(``output_limit``). No mode caps the *sum* of memory of a program's processes (that needs
cgroups) or protects from kernel bugs: run hostile code from unknown sources in a VM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from roll_core.sandbox.host import ENV as _ENV
from roll_core.sandbox.host import hidden_from as _hidden_from
from roll_core.sandbox.host import interpreter_paths as _interpreter
from roll_core.sandbox.host import kill_group, landlock_abi
from roll_core.sandbox.supervisor import supervisor_source

__all__ = [
    "CaseResult",
    "ExecutionResult",
    "Sandbox",
    "SandboxLimits",
    "TestCase",
    "namespaces_available",
]

log = logging.getLogger(__name__)

Mode = Literal["auto", "namespaces", "rlimits"]
Status = Literal[
    "pass", "fail", "error", "timeout", "output_limit", "file_limit", "not_run", "sandbox_error"
]
_STATUSES = set(Status.__args__)  # type: ignore[attr-defined]
_SUPERVISOR = supervisor_source(Path(__file__).with_name("_sandbox_supervisor.py"))


@dataclass(frozen=True)
class TestCase:
    """One test: ``kind="stdio"`` feeds ``stdin`` and compares stdout with ``stdout``;
    ``kind="assert"`` runs ``test`` (Python statements) after the program, in its namespace."""

    __test__: ClassVar[bool] = False  # not a pytest class

    kind: Literal["stdio", "assert"]
    stdin: str = ""
    stdout: str = ""
    test: str = ""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-process limits of a sandboxed program (see the module docstring)."""

    memory_mb: int = 512
    max_processes: int = 8
    max_file_mb: int = 16
    max_output_bytes: int = 1 << 20
    work_dir_mb: int = 64


@dataclass(frozen=True)
class CaseResult:
    """The verdict on one test case.

    ``status``: ``pass``, ``fail`` (wrong output), ``error`` (non-zero exit, exception,
    killed by a signal, or an assert test that did not run to its end), ``timeout`` (wall
    clock or CPU time), ``output_limit``, ``file_limit``, ``not_run`` (an earlier case
    failed and ``stop_on_fail`` is set), ``sandbox_error`` (the sandbox itself failed).
    """

    status: Status
    seconds: float = 0.0
    exit_code: int | None = None
    stderr: str = ""


@dataclass(frozen=True)
class ExecutionResult:
    """What one execution (a program and its cases) produced."""

    cases: tuple[CaseResult, ...]
    mode: str
    seconds: float
    sandbox_error: str | None = None

    @property
    def passed(self) -> int:
        """Cases that passed."""
        return sum(c.status == "pass" for c in self.cases)

    @property
    def all_passed(self) -> bool:
        """Every case passed (False for no cases)."""
        return bool(self.cases) and self.passed == len(self.cases)

    @property
    def timeouts(self) -> int:
        """Cases that ran out of time."""
        return sum(c.status == "timeout" for c in self.cases)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.cache
def namespaces_available(python: str = sys.executable) -> tuple[bool, str]:
    """Whether ``namespaces`` mode works here (a real probe execution), and why not."""
    probe = Sandbox(mode="namespaces", python=python, max_concurrent=1)
    result = probe.run("print(6 * 7)", [TestCase("stdio", stdout="42\n")], [10.0])
    if result.sandbox_error is None and result.all_passed:
        return True, ""
    reason = result.sandbox_error or f"probe program did not pass: {result.cases}"
    return False, reason


class Sandbox:
    """Runs programs against test cases under limits; thread-safe; see the module docstring.

    Args:
        mode: ``auto``, ``namespaces`` or ``rlimits``.
        limits: per-process limits.
        max_concurrent: executions running at once (the bounded pool; more callers wait).
        python: the interpreter that runs programs (default: this one).
        site_packages: let programs import installed packages (numpy, ...); default: the
            standard library only (``python -S``), which also starts faster.
        compare: stdout comparison for ``stdio`` cases: ``lines`` (trailing whitespace of
            each line and trailing blank lines ignored), ``tokens`` (whitespace-separated
            tokens), ``exact``.
        run_as_uid: the uid (and gid) programs run as when roll runs as root.
        startup_s: allowance for starting the supervisor, on top of the case timeouts.
    """

    def __init__(
        self,
        *,
        mode: Mode = "auto",
        limits: SandboxLimits | None = None,
        max_concurrent: int = 2,
        python: str | None = None,
        site_packages: bool = False,
        compare: Literal["lines", "tokens", "exact"] = "lines",
        run_as_uid: int = 65534,
        startup_s: float = 10.0,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.python = python or sys.executable
        self.requested_mode = mode
        self.limits = limits or SandboxLimits()
        self.max_concurrent = max_concurrent
        self.site_packages = site_packages
        self.compare = compare
        self.run_as_uid = run_as_uid
        self.startup_s = startup_s
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._mode: str | None = None if mode == "auto" else mode
        self._mode_lock = threading.Lock()

    @property
    def mode(self) -> str:
        """The mode in use (``auto`` is resolved by a probe on first use)."""
        with self._mode_lock:
            if self._mode is None:
                ok, reason = namespaces_available(self.python)
                self._mode = "namespaces" if ok else "rlimits"
                if not ok:
                    log.warning(
                        "sandbox: namespaces unavailable (%s); code runs in the weaker "
                        "'rlimits' mode (see docs/rewards.md)",
                        reason,
                    )
            if self._mode == "rlimits" and os.geteuid() != 0 and landlock_abi() == 0:
                _warn_once(
                    "sandbox: 'rlimits' mode without Landlock as an ordinary user: programs "
                    "can read every file your uid can read, including /proc/<pid>/environ and "
                    "/proc/<pid>/mem of your other processes (see docs/rewards.md)"
                )
            return self._mode

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_slots")
        state.pop("_mode_lock")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._slots = threading.BoundedSemaphore(self.max_concurrent)
        self._mode_lock = threading.Lock()

    def run(
        self,
        code: str,
        cases: Sequence[TestCase],
        timeouts: Sequence[float],
        *,
        stop_on_fail: bool = False,
    ) -> ExecutionResult:
        """Run ``code`` on each case (``timeouts[i]`` wall seconds for case i). Never raises
        for anything the program does; a failure of the sandbox itself is reported in
        ``sandbox_error`` with every case ``sandbox_error``."""
        if len(cases) != len(timeouts):
            raise ValueError(f"{len(cases)} cases but {len(timeouts)} timeouts")
        mode = self.mode
        with self._slots:
            start = time.perf_counter()
            try:
                results, error = self._execute(mode, code, cases, timeouts, stop_on_fail)
            except Exception as err:  # the host side failed (disk full, fork failed)
                results, error = [], f"{type(err).__name__}: {err}"
            seconds = time.perf_counter() - start
        if error is not None:  # never a kept pass from a sandbox that failed
            results = [CaseResult("sandbox_error") for _ in cases]
        return ExecutionResult(tuple(results), mode, seconds, error)

    def _execute(
        self,
        mode: str,
        code: str,
        cases: Sequence[TestCase],
        timeouts: Sequence[float],
        stop_on_fail: bool,
    ) -> tuple[list[CaseResult], str | None]:
        as_root = os.geteuid() == 0
        program, binds, links = _interpreter(self.python, self.site_packages)
        tmp = None
        try:
            if mode == "namespaces":
                # the fresh tmpfs inside the sandbox's own root, unless it would hide a
                # path to show (an interpreter or venv under the host's /tmp)
                under_tmp = any(b.startswith("/tmp/") for b in binds)
                work = "/work" if under_tmp else "/tmp"
                reveal: list[str] = []
            else:
                tmp = Path(tempfile.mkdtemp(prefix="roll-sandbox-"))
                (tmp / "work").mkdir()
                work = str(tmp / "work")
                reveal = [] if not as_root else _hidden_from(binds, self.run_as_uid)
                if as_root:  # the program's uid must reach and own work/
                    tmp.chmod(0o711)
                    os.chown(work, self.run_as_uid, self.run_as_uid)
            nonce = os.urandom(16).hex()
            spec = {
                "mode": mode,
                "nonce": nonce,
                "work_dir": work,
                "code": code,
                "cases": [
                    {"kind": c.kind, "stdin": c.stdin, "stdout": c.stdout, "test": c.test}
                    for c in cases
                ],
                "timeouts": [float(t) for t in timeouts],
                "stop_on_fail": stop_on_fail,
                "memory_mb": self.limits.memory_mb,
                "max_processes": self.limits.max_processes,
                "max_file_mb": self.limits.max_file_mb,
                "max_output_bytes": self.limits.max_output_bytes,
                "work_dir_mb": self.limits.work_dir_mb,
                "python": program,
                "site_packages": self.site_packages,
                "compare": self.compare,
                "env": {**_ENV, "HOME": work, "TMPDIR": work},
                "map_uid": self.run_as_uid if as_root else None,
                "binds": binds,
                "links": links,
                "reveal": reveal,
            }
            return self._supervise(spec, nonce, len(cases), sum(timeouts) + self.startup_s)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _supervise(
        self, spec: dict[str, Any], nonce: str, n_cases: int, bound: float
    ) -> tuple[list[CaseResult], str | None]:
        """Start the supervisor, send the spec down its stdin pipe, read the verdict from
        its stdout pipe. Anything but exit status 0 and exactly one verdict line carrying
        the nonce is a sandbox error (no case result is kept)."""
        setup = json.dumps({"mode": spec["mode"], "map_uid": spec["map_uid"]})
        proc = subprocess.Popen(
            [self.python, "-I", "-S", "-c", _SUPERVISOR, setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(_ENV),
            cwd="/",
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(json.dumps(spec).encode("utf-8"), timeout=bound)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [], f"the execution overran its bound of {bound:g} s and was killed"
        finally:
            kill_group(proc)  # stragglers of the process group, the namespace's PID 1 too
        if proc.returncode != 0:
            detail = err[-2000:].decode("utf-8", "replace").strip()
            code = proc.returncode
            return [], f"the sandbox supervisor failed (exit code {code}): {detail or 'no output'}"
        try:
            (line,) = out.splitlines()
            verdict = json.loads(line)
            if verdict["nonce"] != nonce or len(verdict["cases"]) != n_cases:
                raise ValueError("wrong nonce or case count")
            return [_parse_case(case) for case in verdict["cases"]], None
        except (ValueError, KeyError, TypeError) as e:
            return [], f"the sandbox supervisor's verdict is not valid ({e}): {out[:200]!r}"


def _parse_case(data: dict[str, Any]) -> CaseResult:
    if data["status"] not in _STATUSES:
        raise ValueError(f"unknown status {data['status']!r}")
    return CaseResult(
        data["status"],
        float(data.get("seconds", 0.0)),
        data.get("exit_code"),
        data.get("stderr", ""),
    )
