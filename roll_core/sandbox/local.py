"""The local sandbox backend: a workspace copy per sandbox, every command in fresh namespaces.

:meth:`LocalBackend.create` copies the source directory into a new private directory on the
host (``<root>/roll-sandbox-XXXX/workspace``, mode 0700 above it; owned by ``run_as_uid``
when roll runs as root). Each :meth:`LocalSandbox.exec` starts a supervisor
(:mod:`roll_core.sandbox._exec_supervisor`) that builds the command's world from nothing:

``namespaces`` mode (where user namespaces work: most Linux hosts, and as root)
    new user, mount, network, PID, IPC and UTS namespaces and a private root holding only
    the system's read-only directories, the interpreter's installation, a fresh ``/proc``,
    a few ``/dev`` nodes, a private ``/tmp`` and the workspace at ``/workspace``. The task
    store (hidden tests, reference fixes), other sandboxes' workspaces, the host's ``/tmp``
    and home directories, its processes and its network do not exist there. When the
    command returns, PID 1 of its namespace kills every process it started (a background
    job, a ``setsid``/double-fork escapee): state between commands lives only in files.
    ``SandboxSpec.read_only`` paths are shown read-only too; a command given a ``tunnel``
    reaches one host address through it and nothing else (:mod:`roll_core.sandbox.tunnel`).
``exec`` mode (``isolation: preferred`` where namespaces do not work)
    as root the command runs as ``run_as_uid``; Landlock (Linux >= 5.13) limits it to
    reading the system's directories and the interpreter and writing the workspace and a
    scratch directory (TCP and, from ABI 6, signals out of the sandbox refused); seccomp
    refuses sockets. Without Landlock an ordinary user's command can read what that user
    can read. Processes are killed by process group only (a ``setsid`` escapee survives
    until :meth:`LocalSandbox.close` is not enough: namespaces are).

Both modes set, per process: address space, CPU seconds, file size, open files, no core
dumps (``namespaces`` also the process count), and cap the output kept. How many commands
run at once is bounded by ``max_concurrent`` (default: the CPU count): a command waits for a
slot, so 8 sandboxes on 2 cores share them instead of thrashing.

No mode caps the *sum* of memory of a command's processes (that needs cgroups) or protects
from kernel bugs: run commands from unknown sources in a VM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from roll_core.errors import SandboxError
from roll_core.sandbox.base import ExecResult, SandboxSpec, Tunnel
from roll_core.sandbox.diff import IGNORED_DIRS, IGNORED_SUFFIXES, diff_trees
from roll_core.sandbox.host import ENV, hidden_from, interpreter_paths, kill_group, landlock_abi
from roll_core.sandbox.supervisor import supervisor_source

__all__ = ["LocalBackend", "LocalSandbox", "WORKDIR"]

log = logging.getLogger(__name__)

WORKDIR = "/workspace"
_SOURCE = supervisor_source(Path(__file__).with_name("_exec_supervisor.py"))
_HINT = (
    "The local sandbox needs unprivileged user namespaces (kernel.unprivileged_userns_clone=1, "
    "no AppArmor userns restriction, or running as root; Docker's default seccomp profile "
    "blocks them). Where that cannot change, set the sandbox's isolation to 'preferred' to "
    "run in the weaker exec mode (docs/swe.md)."
)


def _ignore(_dir: str, names: list[str]) -> set[str]:
    """Caches are not copied; ``.git`` is (an agent may run ``git diff``; :meth:`diff`
    ignores it)."""
    return {n for n in names if (n in IGNORED_DIRS and n != ".git") or n.endswith(IGNORED_SUFFIXES)}


def _tree_bytes(root: Path, limit: int) -> int:
    total = 0
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in IGNORED_DIRS]
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
        if total > limit:
            break
    return total


def _chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid, follow_symlinks=False)
    for top, dirs, names in os.walk(root):
        for name in dirs + names:
            os.chown(os.path.join(top, name), uid, uid, follow_symlinks=False)


def _remove_tree(path: Path) -> None:
    def retry(func: Any, target: str, _exc: Any) -> None:  # a directory left mode 000
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
        with contextlib.suppress(OSError):
            func(target)

    shutil.rmtree(path, onerror=retry)


class LocalBackend:
    """Makes :class:`LocalSandbox` es; see the module docstring.

    Args:
        max_concurrent: commands running at once across all its sandboxes (default: CPUs).
        root: where workspaces are created (default: the system's temporary directory).
    """

    def __init__(self, *, max_concurrent: int | None = None, root: Path | None = None) -> None:
        self.max_concurrent = max_concurrent or os.cpu_count() or 1
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {self.max_concurrent}")
        self.root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.slots = threading.BoundedSemaphore(self.max_concurrent)

    def check(self, spec: SandboxSpec) -> str:
        """The mode ``spec`` gets here (``namespaces`` or ``exec``); see SandboxBackend."""
        python = spec.python or sys.executable
        ok, why = namespaces_work(python, spec.site_packages, spec.run_as_uid)
        if ok:
            return "namespaces"
        if spec.isolation == "required":
            raise SandboxError(
                f"the sandbox needs isolation (isolation: required) but namespaces do not work "
                f"on this machine: {why}",
                hint=_HINT,
            )
        _warn_once(
            f"sandbox: namespaces unavailable ({why}); commands run in the weaker 'exec' "
            f"mode (no private root; Landlock ABI {landlock_abi()}); see docs/swe.md"
        )
        return "exec"

    def create(self, source: Path, spec: SandboxSpec) -> LocalSandbox:
        """A sandbox whose workspace is a copy of ``source`` (see SandboxBackend)."""
        source = Path(source)
        if not source.is_dir():
            raise SandboxError(f"cannot create a sandbox from {source}: not a directory")
        size = _tree_bytes(source, spec.workspace_mb << 20)
        if size > spec.workspace_mb << 20:
            raise SandboxError(
                f"cannot create a sandbox from {source}: more than {spec.workspace_mb} MiB",
                hint="Raise the sandbox's workspace_mb or trim the repository.",
            )
        mode = self.check(spec)
        return LocalSandbox(self, source, spec, mode)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.cache
def namespaces_work(python: str, site_packages: bool, uid: int) -> tuple[bool, str]:
    """Whether a command runs in namespaces mode here (a real probe), and why not."""
    src = Path(tempfile.mkdtemp(prefix="roll-sandbox-probe-"))
    try:
        spec = SandboxSpec(python=python, site_packages=site_packages, run_as_uid=uid)
        box = LocalSandbox(LocalBackend(max_concurrent=1), src, spec, "namespaces")
        try:
            result = box.exec("echo $((6 * 7))", timeout=10.0)
        except SandboxError as err:
            return False, err.message
        finally:
            box.close()
        if result.stdout.strip() == "42":
            return True, ""
        return False, f"the probe command printed {result.output()[:200]!r}"
    finally:
        shutil.rmtree(src, ignore_errors=True)


class LocalSandbox:
    """One workspace on this machine; see the module docstring and :class:`Sandbox`."""

    def __init__(self, backend: LocalBackend, source: Path, spec: SandboxSpec, mode: str) -> None:
        self.backend = backend
        self.source = source
        self.spec = spec
        self.mode = mode
        self.python = spec.python or sys.executable
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._closed = False
        self._as_root = os.geteuid() == 0
        self.relay: Any = None  # the last tunnel's relay (its connection count)
        backend.root.mkdir(parents=True, exist_ok=True)
        if (
            mode == "exec"
            and self._as_root
            and hidden_from([str(backend.root / "x")], spec.run_as_uid)
        ):
            raise SandboxError(
                f"the sandbox root {backend.root} is inside a directory uid {spec.run_as_uid} "
                "cannot enter, so the exec mode cannot run commands there",
                hint="Create sandboxes under a world-traversable directory (the default, "
                "the system's temporary directory) or make namespaces work (docs/swe.md).",
            )
        self.home = Path(tempfile.mkdtemp(prefix="roll-sandbox-", dir=backend.root))
        try:
            self.workspace = self.home / "workspace"
            shutil.copytree(source, self.workspace, symlinks=True, ignore=_ignore)
            self.workspace.chmod(0o755)
            self.scratch = self.home / "scratch"
            self.scratch.mkdir(mode=0o700)
            if self._as_root:
                _chown_tree(self.workspace, spec.run_as_uid)
                os.chown(self.scratch, spec.run_as_uid, spec.run_as_uid)
                self.home.chmod(0o711)  # exec mode: the uid must reach workspace/
        except OSError as err:
            _remove_tree(self.home)
            raise SandboxError(
                f"cannot create a sandbox from {source}: {err}",
                hint="Check free disk space and permissions of the sandbox root directory.",
            ) from err
        self.workdir = WORKDIR if mode == "namespaces" else str(self.workspace)

    # -- commands -------------------------------------------------------------------------

    def exec(
        self,
        command: str,
        timeout: float,
        *,
        stdin: str = "",
        env: dict[str, str] | None = None,
        tunnel: Tunnel | None = None,
    ) -> ExecResult:
        """Run ``command`` with ``/bin/bash -c`` in the workspace (see :class:`Sandbox`).
        A ``tunnel`` needs the namespaces mode (the exec mode refuses sockets)."""
        if self._closed:
            raise SandboxError("this sandbox is closed")
        spec = self._spec(command, stdin, timeout)
        spec["env"].update(env or {})
        if tunnel is None:
            with self.backend.slots:
                return self._supervise(spec, timeout + self.spec.startup_s)
        if self.mode != "namespaces":
            raise SandboxError(
                "a sandbox's way out (a tunnel to the agent endpoint) needs the namespaces "
                f"mode; this sandbox runs in the {self.mode} mode (namespaces unavailable)",
                hint=_HINT,
            )
        from roll_core.sandbox.tunnel import DIR_INSIDE, SOCKET_INSIDE, HostRelay

        uid = self.spec.run_as_uid if self._as_root else None
        try:
            relay = HostRelay(self.home, tunnel.target, uid=uid)
        except OSError as err:
            raise SandboxError(f"cannot open the sandbox's way out: {err}") from None
        self.relay = relay
        spec["tunnels"] = [[int(tunnel.port), SOCKET_INSIDE]]
        spec["ro_binds"].append([str(relay.directory), DIR_INSIDE])
        try:
            with self.backend.slots:
                return self._supervise(spec, timeout + self.spec.startup_s)
        finally:
            relay.close()

    def _spec(self, command: str, stdin: str, timeout: float) -> dict[str, Any]:
        program, binds, links = interpreter_paths(self.python, self.spec.site_packages)
        shown = [os.path.abspath(p) for p in self.spec.read_only]
        as_root = self._as_root
        namespaces = self.mode == "namespaces"
        bindir = os.path.dirname(program)
        env = {
            **ENV,
            "PATH": f"{bindir}:{ENV['PATH']}",
            "HOME": "/tmp" if namespaces else str(self.scratch),
            "TMPDIR": "/tmp" if namespaces else str(self.scratch),
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "GIT_CONFIG_NOSYSTEM": "1",
            **self.spec.env,
        }
        s = self.spec
        return {
            "mode": self.mode,
            "nonce": os.urandom(16).hex(),
            "command": command,
            "stdin": stdin,
            "timeout": float(timeout),
            "shell": "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh",
            "cwd": self.workdir,
            "work_dir": "/tmp" if namespaces else str(self.scratch),
            "work_dir_mb": s.tmp_mb,
            "rw_binds": [[str(self.workspace), WORKDIR]] if namespaces else [],
            "binds": binds if namespaces else [*binds, *shown],
            "ro_binds": [[p, p] for p in shown] if namespaces else [],
            "links": links,
            "map_uid": s.run_as_uid if as_root else None,
            "reveal": []
            if namespaces or not as_root
            else hidden_from([*binds, *shown], s.run_as_uid),
            "require_landlock": False,
            "env": env,
            "memory_mb": s.memory_mb,
            "cpu_s": s.cpu_s,
            "max_file_mb": s.max_file_mb,
            "max_processes": s.max_processes,
            "max_open_files": s.max_open_files,
            "max_output_bytes": s.max_output_bytes,
        }

    def _supervise(self, spec: dict[str, Any], bound: float) -> ExecResult:
        setup = json.dumps({"mode": spec["mode"], "map_uid": spec["map_uid"]})
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", _SOURCE, setup],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(ENV),
                cwd="/",
                start_new_session=True,
            )
        except OSError as start_err:
            raise SandboxError(f"cannot start the sandbox supervisor: {start_err}") from None
        with self._lock:
            self._procs.add(proc)
        try:
            out, errout = proc.communicate(json.dumps(spec).encode("utf-8"), timeout=bound)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            proc.communicate()
            raise SandboxError(
                f"a command overran its bound of {bound:g} s and was killed"
            ) from None
        finally:
            self._kill(proc)
            with self._lock:
                self._procs.discard(proc)
        if self._closed:
            return ExecResult(-signal.SIGKILL, "", "sandbox closed", timed_out=False)
        if proc.returncode != 0:
            detail = errout[-2000:].decode("utf-8", "replace").strip() or "no output"
            raise SandboxError(
                f"the sandbox supervisor failed (exit code {proc.returncode}): {detail}",
                hint=_HINT if "setup" in detail else None,
            )
        return _parse(out, spec["nonce"])

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        kill_group(proc)  # the supervisor, and with it the command's whole namespace

    # -- files ----------------------------------------------------------------------------

    def _open_parent(self, path: str, create: bool) -> tuple[int, str]:
        """A descriptor of ``path``'s directory inside the workspace, walked one component
        at a time without following a symlink, and the file's name."""
        parts = [p for p in Path(path).parts if p not in ("", ".")]
        if Path(path).is_absolute():
            if Path(path).parts[:2] != ("/", WORKDIR.strip("/")) and not path.startswith(
                str(self.workspace) + "/"
            ):
                raise ValueError(f"{path!r} is outside the workspace")
            prefix = WORKDIR if path.startswith(WORKDIR + "/") else str(self.workspace)
            parts = list(Path(os.path.relpath(path, prefix)).parts)
        if not parts or ".." in parts:
            raise ValueError(f"{path!r} is not a file path inside the workspace")
        fd = os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for part in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if self._as_root:
                            uid = self.spec.run_as_uid
                            os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except OSError as err:
            os.close(fd)
            raise ValueError(f"{path!r}: {err.strerror}") from None
        return fd, parts[-1]

    def read_file(self, path: str) -> str:
        """See :class:`Sandbox`."""
        dir_fd, name = self._open_parent(path, create=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as err:
            raise ValueError(f"cannot read {path!r}: {err.strerror}") from None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"cannot read {path!r}: not a regular file")
            return f.read(self.spec.max_file_mb << 20).decode("utf-8", "replace")

    def write_file(self, path: str, text: str) -> None:
        """See :class:`Sandbox`."""
        dir_fd, name = self._open_parent(path, create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as err:
            raise ValueError(f"cannot write {path!r}: {err.strerror}") from None
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"cannot write {path!r}: not a regular file")
            f.write(text.encode("utf-8"))
            if self._as_root:
                os.fchown(f.fileno(), self.spec.run_as_uid, self.spec.run_as_uid)

    def diff(self) -> str:
        """See :class:`Sandbox`."""
        return diff_trees(self.source, self.workspace).text

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """See :class:`Sandbox`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)
        _remove_tree(self.home)

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()


def _parse(out: bytes, nonce: str) -> ExecResult:
    try:
        (line,) = out.splitlines()
        data = json.loads(line)
        if data["nonce"] != nonce:
            raise ValueError("wrong nonce")
        return ExecResult(
            exit_code=int(data["exit_code"]),
            stdout=str(data["stdout"]),
            stderr=str(data["stderr"]),
            truncated=bool(data["truncated"]),
            timed_out=bool(data["timed_out"]),
            seconds=float(data["seconds"]),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise SandboxError(f"the sandbox supervisor's result is not valid ({err})") from None
