"""The sandbox supervisor: runs inside the sandbox, never imported by roll.

:mod:`roll_core.rewards.sandbox` starts it as ``python -I -S -c <this file's source>`` with an
empty environment, in a new session, as an unprivileged user. Standard library only (no
``site``, no roll). It reads a JSON spec on stdin and writes one JSON line per test case to
the results file descriptor named in the spec.

``namespaces`` mode, before any untrusted code runs:

1. ``unshare`` a user, mount, network, PID, IPC and UTS namespace; map the caller's uid/gid
   to 0 inside (nothing else is mapped).
2. Make every mount private, then the whole tree read-only (``mount_setattr`` with
   ``AT_RECURSIVE``); mount a size-limited tmpfs on the work directory and an empty one on
   ``/dev/shm``.
3. Fork: the child is PID 1 of the new PID namespace (it dies with its parent through
   ``PR_SET_PDEATHSIG``, and every process of the namespace dies with it); it mounts a fresh
   ``/proc`` (only the sandbox's processes are visible) and makes itself non-dumpable.

Then, in both modes, for each case: write the program into the work directory, fork a child
that puts itself in its own process group, sets its resource limits, drops every capability
(``namespaces``: securebits ``NOROOT``, empty bounding and capability sets, ``no_new_privs``),
closes every other descriptor and ``execv``\\ s a fresh interpreter running the program: the
program never shares an interpreter with this supervisor, so it cannot read the expected
output. The supervisor reads the program's stdout and stderr through pipes (at most
``max_output_bytes``; more is an ``output_limit`` failure and the program is killed),
enforces the case's wall-clock timeout, kills the program's process group and, in
``namespaces`` mode, every other process of the namespace, and clears the work directory.
"""

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the new-syscall numbers
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECUREBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (all locked)
CAP_VERSION_3 = 0x20080522

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


def fail(reason):
    sys.stderr.write(reason + "\n")
    sys.stderr.flush()
    os._exit(70)


def libc():
    return ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        fail(f"sandbox setup: {what} failed: {os.strerror(err)} (errno {err})")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(spec):
    """Steps 1-3 of the module docstring; returns in PID 1 of the new namespace."""
    lib = libc()
    switch = spec["map_uid"] is not None  # roll runs as root: become an unprivileged uid
    uid = spec["map_uid"] if switch else os.getuid()
    gid = spec["map_uid"] if switch else os.getgid()
    plan = []
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if switch:  # only a process of the parent namespace may map another uid: a helper
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        me = os.getpid()
        helper = os.fork()
        if helper == 0:
            os.read(go_r, 1)
            try:
                write_maps(f"/proc/{me}", uid, gid)
                os.write(done_w, b"y")
            finally:
                os._exit(0)
        check(lib.unshare(flags), "unshare")
        os.write(go_w, b"x")
        ok = os.read(done_r, 1) == b"y"
        os.waitpid(helper, 0)
        if not ok:
            fail("sandbox setup: writing the uid map failed")
        plan = reveal_plan(spec["reveal"])  # still the caller's uid: /root is reachable
        os.setresgid(0, 0, 0)  # inside: 0; outside: the unprivileged uid (caps kept)
        os.setresuid(0, 0, 0)
    else:
        check(lib.unshare(flags), "unshare")
        write_maps("/proc/self", uid, gid)
    mount = lib.mount
    mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    check(mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    mounted = set()
    for hidden, path, fd in plan:
        if hidden not in mounted:
            opts = b"size=1m,mode=0755,uid=0,gid=0"
            check(
                mount(b"tmpfs", hidden.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts),
                "tmpfs " + hidden,
            )
            mounted.add(hidden)
        os.makedirs(path, mode=0o755, exist_ok=True)
        source = f"/proc/self/fd/{fd}".encode()
        check(mount(source, path.encode(), None, MS_BIND | MS_REC, None), "binding " + path)
        os.close(fd)

    class MountAttr(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("set", "clr", "propagation", "userns_fd")]

    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    lib.syscall.restype = ctypes.c_long
    result = lib.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        b"/",
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    check(0 if result == 0 else -1, "making the file system read-only (mount_setattr)")
    work = spec["work_dir"].encode()
    size = f"size={spec['work_dir_mb']}m,mode=0700,uid=0,gid=0".encode()
    check(mount(b"tmpfs", work, b"tmpfs", MS_NOSUID | MS_NODEV, size), "mounting the work tmpfs")
    if os.path.isdir("/dev/shm"):
        opts = b"size=1m,mode=0700,uid=0,gid=0"
        check(mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, opts), "/dev/shm")
    alive_r, alive_w = os.pipe()  # closed when the parent dies
    pid = os.fork()
    if pid:  # outside the PID namespace: wait for PID 1 and pass its exit status on
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 71)
    os.close(alive_w)
    lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if select.select([alive_r], [], [], 0)[0]:  # the parent died before the line above
        os._exit(71)
    os.close(alive_r)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    check(mount(b"proc", b"/proc", b"proc", flags, None), "mounting /proc")
    lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def write_maps(proc, uid, gid):
    write_file(proc + "/setgroups", "deny")
    write_file(proc + "/uid_map", f"0 {uid} 1")
    write_file(proc + "/gid_map", f"0 {gid} 1")


def reveal_plan(paths):
    """How to make ``paths`` (the interpreter's prefix) reachable for the unprivileged uid.

    The topmost ancestor that others cannot traverse (``/root`` for a pyenv Python) gets an
    empty tmpfs holding only the way down to each prefix, which is bind-mounted back in
    place (from a descriptor opened in the new mount namespace before the uid switch): the rest of that
    directory stays hidden. Returns ``(hidden ancestor, path, O_PATH descriptor)``.
    """
    plan = []
    for path in paths:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                plan.append((ancestor, path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
                break
    return plan


def drop_privileges():
    """In the program's child, namespaces mode: no capability now or after execve."""
    lib = libc()
    check(lib.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(lib.capset(header, data), "dropping capabilities")
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def set_limits(spec, timeout):
    cpu = int(timeout) + 2
    limits = [
        (resource.RLIMIT_AS, spec["memory_mb"] << 20),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, spec["max_file_mb"] << 20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, spec["max_processes"]),
    ]
    for which, value in limits:
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            if which in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC):
                raise


def temp_fd(work, name, data):
    """An open, already unlinked file holding ``data`` (the program cannot find it by name)."""
    path = os.path.join(work, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def start_case(spec, case, timeout, nonce):
    work = spec["work_dir"]
    stdin_fd = temp_fd(work, ".stdin", (case.get("stdin") or "").encode())
    test_fd = temp_fd(work, ".test", (nonce + "\n" + (case.get("test") or "")).encode())
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            for src, dst in ((stdin_fd, 0), (out_w, 1), (err_w, 2), (status_w, 3), (test_fd, 4)):
                os.dup2(src, dst)
            os.closerange(5, 1 << 16)
            os.chdir(work)
            set_limits(spec, timeout)
            if spec["mode"] == "namespaces":
                drop_privileges()
            args = [spec["python"], "-I"] + ([] if spec["site_packages"] else ["-S"])
            os.execve(spec["python"], args + ["-c", RUNNER, case["kind"]], spec["env"])
        except BaseException as err:
            os.write(2, f"sandbox: cannot start the program: {err!r}\n".encode())
        os._exit(72)
    for fd in (stdin_fd, test_fd, out_w, err_w, status_w):
        os.close(fd)
    return pid, out_r, err_r, status_r


def kill_everything(pid):
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def kill_namespace_rest():
    """PID 1 of the sandbox: kill every other process of the namespace (setsid escapees)."""
    me = os.getpid()
    for _ in range(3):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
        if not others:
            return
        for p in others:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        reap()


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_case(spec, case, timeout):
    nonce = os.urandom(16).hex()
    start = time.monotonic()
    pid, out_r, err_r, status_r = start_case(spec, case, timeout, nonce)
    cap = spec["max_output_bytes"]
    out, err, status = bytearray(), bytearray(), bytearray()
    streams = {out_r: out, err_r: err, status_r: status}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    deadline = start + timeout
    verdict, wstatus, exited = None, 0, False
    while verdict is None:
        left = deadline - time.monotonic()
        if left <= 0:
            verdict = "timeout"
            break
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
    seconds = time.monotonic() - start
    kill_everything(pid)
    if not exited:
        _, wstatus = os.waitpid(pid, 0)
    if spec["mode"] == "namespaces":
        kill_namespace_rest()
    reap()
    for fd in list(streams):
        os.close(fd)
    code = os.waitstatus_to_exitcode(wstatus)
    completed = bytes(status) == nonce.encode()
    if verdict is None:
        if code == -signal.SIGXCPU:
            verdict = "timeout"
        elif code == -signal.SIGXFSZ:
            verdict = "file_limit"
        elif code != 0 or (case["kind"] == "assert" and not completed):
            verdict = "error"
        elif case["kind"] == "stdio":
            same = same_output(out.decode("utf-8", "replace"), case["stdout"], spec["compare"])
            verdict = "pass" if same else "fail"
        else:
            verdict = "pass"
    return {
        "status": verdict,
        "seconds": seconds,
        "exit_code": code,
        "stderr": err[-1000:].decode("utf-8", "replace"),
    }


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
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                os.rmdir(path)


def main():
    spec = json.loads(sys.stdin.buffer.read())
    results = os.fdopen(spec["results_fd"], "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if spec["mode"] == "namespaces":
        enter_namespaces(spec)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stop = False
    for case, timeout in zip(spec["cases"], spec["timeouts"], strict=False):
        if stop:
            results.write(json.dumps({"status": "not_run", "seconds": 0.0}) + "\n")
            continue
        clear_work(spec["work_dir"])
        with open(os.path.join(spec["work_dir"], "solution.py"), "w", encoding="utf-8") as f:
            f.write(spec["code"])
        result = run_case(spec, case, timeout)
        results.write(json.dumps(result) + "\n")
        results.flush()
        stop = spec["stop_on_fail"] and result["status"] != "pass"
    results.close()
    os._exit(0)


main()
