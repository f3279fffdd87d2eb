"""The sandbox supervisor: runs the program on each case; never imported by roll.

:mod:`roll_core.rewards.sandbox` starts it as ``python -I -S -c <source>`` (this file after
:mod:`roll_core.rewards._sandbox_confine`) with an empty environment, in a new session.
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
MNT_DETACH = 2
MOUNT_ATTR_RDONLY = 0x1
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the new-syscall numbers
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_CAP_AMBIENT = 28, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECUREBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (all locked)
CAP_VERSION_3 = 0x20080522
DEVICES = ("null", "zero", "full", "random", "urandom")
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


def fail(reason):
    sys.stderr.write(reason + "\n")
    sys.stderr.flush()
    os._exit(70)


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    return lib


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        fail(f"sandbox setup: {what} failed: {os.strerror(err)} (errno {err})")


def nondumpable(lib):
    check(lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_maps(proc, uid, gid):
    write_file(proc + "/setgroups", "deny")
    write_file(proc + "/uid_map", f"0 {uid} 1")
    write_file(proc + "/gid_map", f"0 {gid} 1")


def enter_user_namespace(lib, setup):
    """Step 1: new namespaces and the uid map. Runs before the spec is read: a process may
    only write its own map while it is still dumpable."""
    switch = setup["map_uid"] is not None  # roll runs as root: become an unprivileged uid
    uid = setup["map_uid"] if switch else os.getuid()
    gid = setup["map_uid"] if switch else os.getgid()
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
    else:
        check(lib.unshare(flags), "unshare")
        write_maps("/proc/self", uid, gid)


def enter_namespaces(lib, spec):
    """Steps 2-3 of the module docstring; returns in PID 1, inside the new root."""
    switch = spec["map_uid"] is not None
    # still the caller's credentials: open what the new root shows (a pyenv under /root too)
    sources = []
    for path in spec["binds"]:
        with contextlib.suppress(FileNotFoundError):
            sources.append((path, os.open(path, os.O_PATH), os.path.isdir(path)))
    if switch:
        os.setresgid(0, 0, 0)  # inside: 0; outside: the unprivileged uid
        os.setresuid(0, 0, 0)
    nondumpable(lib)  # a change of credentials resets it
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
    build_root(lib, spec, sources)
    nondumpable(lib)


def mount(lib, source, target, fstype, flags, opts, what):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(lib.mount(enc(source), enc(target), enc(fstype), flags, enc(opts)), what)


def build_root(lib, spec, sources):
    """Step 3: the new root on a tmpfs, then ``pivot_root`` into it."""
    mount(lib, None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")
    new = "/tmp"  # mounted over in this private mount namespace only
    mount(lib, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", "the root tmpfs")
    for path, fd, is_dir in sources:
        target = new + path
        if is_dir:
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(lib, f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None, "binding " + path)
        os.close(fd)
    for link, dest in spec["links"]:
        if not os.path.lexists(new + link):
            os.symlink(dest, new + link)
    for d in ("/proc", "/dev", spec["work_dir"]):
        os.makedirs(new + d, exist_ok=True)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    mount(lib, "proc", new + "/proc", "proc", flags, None, "mounting /proc")
    set_readonly(lib, new, AT_RECURSIVE)
    mount(lib, "tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755", "/dev")
    for name in DEVICES:
        target = f"{new}/dev/{name}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        mount(lib, "/dev/" + name, target, None, MS_BIND, None, "binding /dev/" + name)
    os.mkdir(new + "/dev/shm")
    set_readonly(lib, new + "/dev", 0)
    opts = "size=1m,mode=0700,uid=0,gid=0"
    mount(lib, "tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts, "/dev/shm")
    opts = f"size={spec['work_dir_mb']}m,mode=0700,uid=0,gid=0"
    work = new + spec["work_dir"]
    mount(lib, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, opts, "the work tmpfs")
    os.chdir(new)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        fail(f"sandbox setup: no pivot_root number for {os.uname().machine}")
    check(0 if lib.syscall(ctypes.c_long(nr), b".", b".") == 0 else -1, "pivot_root")
    check(lib.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")


def set_readonly(lib, path, flags):
    class MountAttr(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("set", "clr", "propagation", "userns_fd")]

    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    result = lib.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    check(0 if result == 0 else -1, f"making {path} read-only (mount_setattr)")


def enter_rlimits(lib, spec):
    """As root: show the interpreter's prefix if needed, then become ``run_as_uid``."""
    uid = spec["map_uid"]
    if uid is None:
        return
    if spec["reveal"]:
        if lib.unshare(CLONE_NEWNS) != 0:
            fail(
                f"the interpreter lives in a directory uid {uid} cannot enter, and this "
                "process may not create a mount namespace to show it (no CAP_SYS_ADMIN); set "
                "the code reward's sandbox.python to an interpreter outside private "
                "directories (e.g. /usr/bin/python3)"
            )
        mount(lib, None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")
        reveal(lib, spec["reveal"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    nondumpable(lib)


def reveal(lib, paths):
    """The topmost ancestor of each path that others cannot enter (``/root``) gets an empty
    tmpfs holding only the way down to the path, which is bind-mounted back read-only."""
    plan = []
    for path in paths:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                plan.append((ancestor, path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
                break
    covered = set()
    for hidden, path, fd in plan:
        if hidden not in covered:
            opts = "size=1m,mode=0755"
            mount(lib, "tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, opts, "tmpfs " + hidden)
            covered.add(hidden)
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(lib, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, "binding " + path)
        os.close(fd)
        set_readonly(lib, path, AT_RECURSIVE)


def drop_capabilities(lib):
    """In the program's child, namespaces mode: no capability now or after execve."""
    check(lib.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    check(lib.capset(header, data), "dropping capabilities")


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
            # landlock_restrict, install_seccomp: from _sandbox_confine (prepended)
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
