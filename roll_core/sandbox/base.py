"""The sandbox interface: an isolated copy of a repository an agent or a grader works in.

A :class:`SandboxBackend` makes :class:`Sandbox` es from a source directory and a
:class:`SandboxSpec`; a sandbox runs shell commands in its workspace (:meth:`Sandbox.exec`),
reads and writes its files from the host side, reports how its workspace differs from the
source (:meth:`Sandbox.diff`, a unified diff ``git apply`` takes), and is closed once
(:meth:`Sandbox.close`: every process it started is killed, its workspace removed).

Only the local backend (:mod:`roll_core.sandbox.local`: namespaces and rlimits on this
machine) exists. A container or remote backend (Docker/Podman, ROCK, E2B, Daytona) implements
the same two protocols: ``create`` copies or uploads the source, ``exec`` is the service's
command call with its timeout, ``read_file``/``write_file`` its file API, ``diff`` the same
function over the files it lists; :class:`ExecResult` and :class:`SandboxSpec` stay as they
are (a backend that cannot honour a limit says so in :meth:`SandboxBackend.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

__all__ = ["ExecResult", "Sandbox", "SandboxBackend", "SandboxSpec", "Tunnel"]


@dataclass(frozen=True)
class SandboxSpec:
    """What one sandbox may use and how strongly it is isolated."""

    isolation: Literal["required", "preferred"] = "required"
    """``required``: namespaces (no network, a private root showing only the workspace and
    the system's read-only directories) or a :class:`~roll_core.errors.SandboxError` at
    creation. ``preferred``: fall back to the weaker ``exec`` mode (another uid when roll
    runs as root, Landlock, no sockets; see docs/swe.md) with a warning."""

    memory_mb: int = 1024
    """Address-space limit of every process in the sandbox (``RLIMIT_AS``), MiB."""

    cpu_s: int = 120
    """CPU seconds of every process (``RLIMIT_CPU``); a command that spends them is killed
    and reported as timed out."""

    max_file_mb: int = 64
    """Largest file a process may write (``RLIMIT_FSIZE``), MiB."""

    max_processes: int = 64
    """Processes at once inside the sandbox (``RLIMIT_NPROC`` of its own user namespace);
    namespaces mode only."""

    max_open_files: int = 256
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""

    max_output_bytes: int = 1 << 16
    """stdout and stderr kept per command, each (the first and last halves; the note
    ``[... N bytes of output cut ...]`` marks the cut). More than 16 times this much output
    kills the command."""

    tmp_mb: int = 256
    """Size of the sandbox's private ``/tmp`` (a tmpfs, counted as memory), MiB."""

    workspace_mb: int = 512
    """Largest source directory a sandbox copies, MiB (a bigger one is refused)."""

    python: str | None = None
    """The interpreter shown inside (its installation read-only, on ``PATH`` first);
    default: the one running roll."""

    site_packages: bool = True
    """Show the interpreter's virtualenv too (pytest must be importable to grade)."""

    run_as_uid: int = 65534
    """The uid commands run as when roll runs as root (``nobody``)."""

    startup_s: float = 10.0
    """Allowance for starting a command's supervisor, on top of its timeout, s."""

    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for commands (nothing of roll's own environment is
    passed)."""

    read_only: tuple[str, ...] = ()
    """Host paths shown read-only at the same path inside (a harness's installation or
    configuration); nothing else of the host's file system is."""


@dataclass(frozen=True)
class Tunnel:
    """A command's one way out of its sandbox: ``127.0.0.1:port`` inside reaches ``target``
    on the host, and nothing else does (:mod:`roll_core.sandbox.tunnel`)."""

    port: int
    """The port a process inside connects to (on the sandbox's own loopback)."""

    target: tuple[str, int]
    """The host address every connection is relayed to (e.g. the agent endpoint's)."""


@dataclass(frozen=True)
class ExecResult:
    """What one command did."""

    exit_code: int
    """The shell's exit status; ``-N`` when it was killed by signal N."""

    stdout: str
    """Its standard output (head and tail when ``truncated``)."""

    stderr: str
    """Its standard error (head and tail when ``truncated``)."""

    truncated: bool = False
    """Output was cut (or the command was killed for flooding it)."""

    timed_out: bool = False
    """The wall-clock timeout or the CPU limit ended it."""

    seconds: float = 0.0
    """Wall time of the command inside the sandbox."""

    @property
    def ok(self) -> bool:
        """Exited 0 within its time."""
        return self.exit_code == 0 and not self.timed_out

    def output(self) -> str:
        """stdout then stderr, as an agent's observation shows them."""
        if self.stderr and self.stdout:
            return self.stdout.rstrip("\n") + "\n" + self.stderr
        return self.stdout or self.stderr


@runtime_checkable
class Sandbox(Protocol):
    """One isolated workspace; thread-safe for ``close`` against a running ``exec``."""

    workdir: str
    """The workspace's path as commands inside see it (their working directory)."""

    def exec(
        self,
        command: str,
        timeout: float,
        *,
        stdin: str = "",
        env: dict[str, str] | None = None,
        tunnel: Tunnel | None = None,
    ) -> ExecResult:
        """Run ``command`` with the shell in the workspace; every process it started is
        killed when it returns or after ``timeout`` seconds. Never raises for what the
        command does; a broken sandbox raises :class:`~roll_core.errors.SandboxError`.
        ``env``: more variables for this command; ``tunnel``: its one way out (a backend
        that cannot make one raises SandboxError)."""
        ...

    def read_file(self, path: str) -> str:
        """A workspace file's text (``path`` relative to the workspace; symlinks and paths
        leading out of it are refused with ValueError)."""
        ...

    def write_file(self, path: str, text: str) -> None:
        """Create or replace a workspace file (parents created), as the sandbox's uid."""
        ...

    def diff(self) -> str:
        """The workspace against the source it was copied from, as a unified diff with
        ``a/``/``b/`` prefixes (text files; caches and ``.git`` ignored)."""
        ...

    def close(self) -> None:
        """Kill anything still running and remove the workspace; idempotent."""
        ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc: object) -> None: ...


class SandboxBackend(Protocol):
    """Makes sandboxes; bounds how many commands run at once."""

    def check(self, spec: SandboxSpec) -> str:
        """The isolation ``spec`` gets here (``namespaces``, ``exec``); raises
        :class:`~roll_core.errors.SandboxError` when it cannot be met."""
        ...

    def create(self, source: Path, spec: SandboxSpec) -> Sandbox:
        """A new sandbox whose workspace is a copy of the directory ``source``."""
        ...
