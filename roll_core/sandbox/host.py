"""Host-side facts every sandbox backend needs: what an interpreter needs to be shown, which
of those paths an unprivileged uid cannot enter, the kernel's Landlock ABI, a clean
environment."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["ENV", "hidden_from", "interpreter_paths", "landlock_abi"]

ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
"""The whole environment of a supervisor (and the base of a sandboxed program's): nothing of
the caller's environment (API keys, tokens) reaches a sandbox."""


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: unavailable); rlimits mode uses it."""
    import ctypes

    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    abi = lib.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(abi))


_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")


@functools.cache
def interpreter_paths(python: str, site_packages: bool) -> tuple[str, list[str], list[list[str]]]:
    """What a program needs: the interpreter to execute, the paths the sandbox shows it
    (read-only: the system's library directories, the interpreter's installation and, with
    ``site_packages``, its virtualenv) and the top-level symlinks to recreate (``/lib``).

    The probe runs without ``-S`` so that a virtualenv's ``sys.prefix`` is the venv (with
    ``-S`` it is the base installation). Without ``site_packages`` the program runs on the
    base interpreter (``-I -S``: standard library only), so the venv is not shown at all.
    """
    code = "import sys; print(sys.base_prefix); print(sys.prefix)"
    out = subprocess.run(
        [python, "-I", "-c", code], capture_output=True, text=True, check=True, env=ENV
    ).stdout.splitlines()
    base, venv = os.path.realpath(out[0]), os.path.realpath(out[1])
    real = os.path.realpath(python)
    binds: list[str] = []
    links: list[list[str]] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            binds.append(path)
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    wanted = [base, os.path.dirname(real)]
    if site_packages and venv != base:
        wanted.append(venv)
    for path in wanted:
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(path)
    program = os.path.abspath(python) if site_packages else real
    return program, binds, links


def hidden_from(paths: list[str], uid: int) -> list[str]:
    """The paths below a directory that ``uid`` cannot enter (rlimits mode as root)."""
    hidden = []
    for path in paths:
        parents = Path(path).parents
        if not all(p.stat().st_mode & 0o001 or p.stat().st_uid == uid for p in parents):
            hidden.append(path)
    return hidden


def kill_group(proc: subprocess.Popen[bytes], *, wait_s: float = 10.0) -> None:
    """SIGKILL the process group `proc` leads (it was started in a session of its own), reap
    `proc`, then wait until no member of the group is alive. A sandbox supervisor's group holds
    PID 1 of the command's PID namespace, which leaves only after every process of its
    namespace has (the kernel kills them when it dies): so nothing `proc` started in its group
    outlives this call. Bounded: a member that does not die within `wait_s` is left."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=wait_s)
    deadline = time.monotonic() + wait_s
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False  # no member at all: the usual case, at no cost
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat_line = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat_line[stat_line.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False
