"""The sandbox supervisor: runs the program on each case; never imported by roll.

:mod:`roll_core.rewards.sandbox` starts it as ``python -I -S -c <source>`` (this file after
:mod:`roll_core.sandbox._confine` and :mod:`roll_core.sandbox._namespaces`) with an empty environment, in a new session.
Standard library only. Its first act is ``PR_SET_DUMPABLE = 0``: from then on no process
without ``CAP_SYS_PTRACE`` over it (the program included, whatever its uid) can read its
memory (``/proc/<pid>/mem``, ``ptrace``, ``process_vm_readv``) or open its descriptors
through ``/proc``. Only then does it read the spec (the program, every case's input and
expected output, a nonce) from its stdin pipe. The expected outputs stay in this process's
memory: no file ever holds them. The verdict goes back on its stdout pipe as one JSON line
that carries the nonce, written after the last program has exited; the host accepts nothing
else.

``namespaces`` mode, before any untrusted code runs:

1. ``unshare`` a user, mount, network, PID, IPC and UTS namespace; map one uid to 0 inside
   (the caller's, or ``run_as_uid`` through a helper in the parent namespace when roll runs
   as root).
2. Fork: the child is PID 1 of the new PID namespace (it dies with its parent through
   ``PR_SET_PDEATHSIG``; every process of the namespace dies with it).
3. PID 1 builds a new root on an empty tmpfs: the interpreter's prefix and the system's
   library directories bind-mounted read-only, a fresh ``/proc``, a ``/dev`` holding only
   ``null zero full random urandom``, an empty ``/dev/shm`` and a ``work_dir_mb`` tmpfs at
   ``/tmp`` (the work directory; ``/work`` when an interpreter path to show lies under
   ``/tmp``); then ``pivot_root`` into it and detach the old root. No
   host file, socket or other sample's directory exists in that tree.

``rlimits`` mode: when roll runs as root, become ``run_as_uid`` (after revealing only the
interpreter's prefix in a private mount namespace when it lives in a directory that uid
cannot enter, e.g. ``/root``).

Then, in both modes, for each case: write the program into the work directory, fork a child
that puts itself in its own process group, dies with this process (``PR_SET_PDEATHSIG``),
sets its resource limits, drops every capability (``namespaces``), confines itself
(Landlock in ``rlimits`` mode, the seccomp filter in both), closes every other descriptor and
``execve``\\ s a fresh interpreter running the program. The supervisor reads the program's
stdout and stderr through pipes (at most ``max_output_bytes``; more is ``output_limit``),
enforces the wall-clock timeout, kills the program's process group (and in ``namespaces``
mode every other process of the namespace), compares the output, and clears the work
directory.
"""

import contextlib
import json
import os
import resource
import select
import signal
import sys
import time

START_FAILED = 72

RUNNER = r"""
import os, sys
def _main():
    kind = sys.argv[1]
    with os.fdopen(4, "rb") as f:
        test = f.read().decode("utf-8")
    nonce, _, test = test.partition("\n")
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["solution.py"]
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    status = 0
    try:
        exec(compile(source, "solution.py", "exec"), scope)
        if kind == "assert":
            exec(compile(test, "test", "exec"), scope)
    except SystemExit as err:
        status = 0 if err.code is None else err.code if isinstance(err.code, int) else 1
        if kind == "assert":
            status = 1 if status == 0 else status  # exiting before the asserts ran is a failure
    except BaseException as err:
        import traceback
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 1
    if status == 0:
        os.write(3, nonce.encode())
    os._exit(status)
_main()
"""


def set_limits(spec, timeout):
    limits = [
        (resource.RLIMIT_AS, spec["memory_mb"] << 20),
        (resource.RLIMIT_CPU, int(timeout) + 2),
        (resource.RLIMIT_FSIZE, spec["max_file_mb"] << 20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ]
    if spec["mode"] == "namespaces":  # counted per user namespace: this sandbox only
        limits.append((resource.RLIMIT_NPROC, spec["max_processes"]))
    for which, value in limits:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            if which != resource.RLIMIT_NOFILE and which != resource.RLIMIT_CORE:
                raise


def temp_fd(work, name, data):
    """An open, already unlinked file holding ``data`` (the program's own input)."""
    path = os.path.join(work, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def exec_program(lib, spec, case, timeout, parent):
    """In the forked child: confine, then become the program (never returns)."""
    try:
        os.setpgid(0, 0)
        os.closerange(5, 1 << 16)
        os.chdir(spec["work_dir"])
        set_limits(spec, timeout)
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(START_FAILED)
        if spec["mode"] == "namespaces":
            drop_capabilities(lib)
        else:
            # landlock_restrict, install_seccomp: from _confine (prepended)
            readable = spec["binds"] + ["/dev/urandom", "/dev/zero"]
            landlock_restrict(lib, readable, [spec["work_dir"], "/dev/null"])  # noqa: F821
        install_seccomp(lib, spec["mode"], os.getpid())  # noqa: F821
        args = [spec["python"], "-I"] + ([] if spec["site_packages"] else ["-S"])
        os.execve(spec["python"], args + ["-c", RUNNER, case["kind"]], spec["env"])
    except BaseException as err:
        os.write(2, f"sandbox: cannot start the program: {err!r}\n".encode())
    os._exit(START_FAILED)


def start_case(lib, spec, case, timeout, nonce):
    work = spec["work_dir"]
    stdin_fd = temp_fd(work, ".stdin", (case.get("stdin") or "").encode())
    test_fd = temp_fd(work, ".test", (nonce + "\n" + (case.get("test") or "")).encode())
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        for src, dst in ((stdin_fd, 0), (out_w, 1), (err_w, 2), (status_w, 3), (test_fd, 4)):
            os.dup2(src, dst)
        exec_program(lib, spec, case, timeout, parent)
    for fd in (stdin_fd, test_fd, out_w, err_w, status_w):
        os.close(fd)
    return pid, out_r, err_r, status_r


def collect(pid, streams, deadline, cap, out_r, err_r):
    """Read the program's pipes until it exits (and they drain) or the deadline."""
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    verdict, wstatus, exited = None, 0, False
    while verdict is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout", wstatus, exited
        events = poller.poll(min(left, 0.05) * 1000) if streams else time.sleep(min(left, 0.005))
        for fd, _ in events or ():
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poller.unregister(fd)
                os.close(fd)
                del streams[fd]
                continue
            buf = streams[fd]
            buf += chunk
            if fd == err_r and len(buf) > 4096:
                del buf[: len(buf) - 4096]
            if fd == out_r and len(buf) > cap:
                verdict = "output_limit"
        if exited and not events:  # the program is gone and its pipes are drained
            break
        if not exited:
            done, wstatus = os.waitpid(pid, os.WNOHANG)
            exited = done != 0
    return verdict, wstatus, exited


def run_case(lib, spec, case, timeout):
    nonce = os.urandom(16).hex()
    start = time.monotonic()
    pid, out_r, err_r, status_r = start_case(lib, spec, case, timeout, nonce)
    out, err, status = bytearray(), bytearray(), bytearray()
    streams = {out_r: out, err_r: err, status_r: status}
    cap = spec["max_output_bytes"]
    verdict, wstatus, exited = collect(pid, streams, start + timeout, cap, out_r, err_r)
    seconds = time.monotonic() - start
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    if not exited:
        _, wstatus = os.waitpid(pid, 0)
    if spec["mode"] == "namespaces":
        kill_namespace_rest()
    reap()
    for fd in list(streams):
        os.close(fd)
    code = os.waitstatus_to_exitcode(wstatus)
    if code == START_FAILED and err.startswith(b"sandbox: cannot start the program"):
        fail(err.decode("utf-8", "replace").strip())  # a broken sandbox, not a wrong program
    if verdict is None:
        verdict = judge(spec, case, code, bytes(status) == nonce.encode(), out)
    return {
        "status": verdict,
        "seconds": seconds,
        "exit_code": code,
        "stderr": err[-1000:].decode("utf-8", "replace"),
    }


def judge(spec, case, code, completed, out):
    if code == -signal.SIGXCPU:
        return "timeout"
    if code == -signal.SIGXFSZ:
        return "file_limit"
    if code != 0 or (case["kind"] == "assert" and not completed):
        return "error"
    if case["kind"] == "stdio":
        same = same_output(out.decode("utf-8", "replace"), case["stdout"], spec["compare"])
        return "pass" if same else "fail"
    return "pass"


def same_output(got, expected, compare):
    if compare == "exact":
        return got == expected
    if compare == "tokens":
        return got.split() == expected.split()
    lines = lambda s: [x.rstrip() for x in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


def clear_work(work):
    for root, dirs, files in os.walk(work, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))


def main():
    lib = libc()
    setup = json.loads(sys.argv[1])  # mode and uid only: nothing secret
    if setup["mode"] == "namespaces":
        enter_user_namespace(lib, setup)
    nondumpable(lib)  # before the spec (the expected outputs) is in this process
    spec = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if spec["mode"] == "namespaces":
        enter_namespaces(lib, spec)
    else:
        enter_rlimits(lib, spec)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    results, stop = [], False
    for case, timeout in zip(spec["cases"], spec["timeouts"], strict=False):
        if stop:
            results.append({"status": "not_run", "seconds": 0.0})
            continue
        clear_work(spec["work_dir"])
        with open(os.path.join(spec["work_dir"], "solution.py"), "w", encoding="utf-8") as f:
            f.write(spec["code"])
        result = run_case(lib, spec, case, timeout)
        results.append(result)
        stop = spec["stop_on_fail"] and result["status"] != "pass"
    clear_work(spec["work_dir"])
    verdict = json.dumps({"nonce": spec["nonce"], "cases": results}).encode() + b"\n"
    view = memoryview(verdict)
    while view:
        view = view[os.write(1, view) :]
    os._exit(0)


main()
