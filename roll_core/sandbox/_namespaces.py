"""Namespaces, a private root and dropped privileges for a sandbox supervisor; never imported.

Part of a supervisor's source: :mod:`roll_core.rewards.sandbox` (the code reward's test-case
runner) and :mod:`roll_core.sandbox.local` (the SWE workspace sandbox) each start ``python -I
-S -c`` on :mod:`roll_core.sandbox._confine`, this file and their own supervisor file, in that
order. Standard library only; see each supervisor's docstring for the order of the steps.

* :func:`enter_user_namespace`: ``unshare`` a user, mount, network, PID, IPC and UTS
  namespace and map one uid to 0 inside (the caller's, or ``map_uid`` through a helper in the
  parent namespace when the caller is root).
* :func:`enter_namespaces`: fork PID 1 of the new PID namespace (it dies with its parent)
  and :func:`build_root`: a new root on an empty tmpfs holding the ``binds`` read-only, a
  fresh ``/proc``, a ``/dev`` of ``null zero full random urandom``, an empty ``/dev/shm``, a
  ``work_dir_mb`` tmpfs at ``work_dir`` and the ``rw_binds`` (host directory, path inside)
  read-write; then ``pivot_root`` and detach the old root.
* :func:`enter_rlimits`: without namespaces, as root: show the interpreter's prefix if its
  uid cannot enter it, then become ``map_uid``.
* :func:`drop_capabilities`, :func:`kill_namespace_rest`, :func:`reap`.
"""

import contextlib
import ctypes
import os
import select
import signal
import sys

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
    writable = [
        (inside, os.open(host, os.O_PATH | os.O_DIRECTORY))
        for host, inside in spec.get("rw_binds", [])
    ]
    readonly = [
        (inside, os.open(host, os.O_PATH), os.path.isdir(host))
        for host, inside in spec.get("ro_binds", [])
        if os.path.exists(host)
    ]
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
    build_root(lib, spec, sources, writable, readonly)
    nondumpable(lib)


def mount(lib, source, target, fstype, flags, opts, what):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(lib.mount(enc(source), enc(target), enc(fstype), flags, enc(opts)), what)


def build_root(lib, spec, sources, writable=(), readonly=()):
    """Step 3: the new root on a tmpfs, then ``pivot_root`` into it. ``writable``: (path
    inside, an ``O_PATH`` descriptor of the host directory) bound read-write; ``readonly``:
    (path inside, an ``O_PATH`` descriptor, is a directory), bound read-only after the work
    tmpfs (so a path under ``/tmp`` shows too): shown host paths, a way-out socket."""
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
    for d in ("/proc", "/dev", spec["work_dir"], *(inside for inside, _ in writable)):
        os.makedirs(new + d, exist_ok=True)
    for inside, _, is_dir in readonly:
        mount_point(new + inside, is_dir)
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
    for inside, fd in writable:
        mount(lib, f"/proc/self/fd/{fd}", new + inside, None, MS_BIND, None, "binding " + inside)
        os.close(fd)
    for inside, fd, is_dir in readonly:
        mount_point(new + inside, is_dir)  # again: the work tmpfs may cover the first one
        flags = MS_BIND | MS_REC
        mount(lib, f"/proc/self/fd/{fd}", new + inside, None, flags, None, "binding " + inside)
        os.close(fd)
        set_readonly(lib, new + inside, AT_RECURSIVE)
    os.chdir(new)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        fail(f"sandbox setup: no pivot_root number for {os.uname().machine}")
    check(0 if lib.syscall(ctypes.c_long(nr), b".", b".") == 0 else -1, "pivot_root")
    check(lib.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")


def mount_point(target, is_dir):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    elif not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


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
