"""The SWE sandbox's supervisor: runs one shell command in the workspace; never imported.

:class:`roll_core.sandbox.local.LocalSandbox` starts it for every :meth:`exec` as ``python
-I -S -c <source>`` (:mod:`roll_core.sandbox._confine`, :mod:`roll_core.sandbox._namespaces`,
then this file) with an empty environment, in a new session, and sends the spec (the
command, its stdin, limits, the paths to show, a nonce) down its stdin pipe. The result goes
back on its stdout pipe as one JSON line carrying the nonce, written after the command and
everything it started are gone; the host accepts nothing else.

``namespaces`` mode: new user, mount, network, PID, IPC and UTS namespaces (the caller's uid,
or ``run_as_uid`` when roll runs as root, is 0 inside and holds no capability over anything
outside); PID 1 of the new PID namespace builds a root holding only the system's library
directories and the interpreter's installation (read-only), a fresh ``/proc``, the
``/dev/{null,zero,full,random,urandom}`` devices, a ``work_dir_mb`` tmpfs at ``/tmp`` and
the episode's workspace, read-write, at ``/workspace``. Nothing else of the host exists in
that tree: no task store (hidden tests, reference fixes), no other episode's workspace, no
network interface but a down loopback. ``exec`` mode (no namespaces): as root become
``run_as_uid``; Landlock allows reading the same directories and writing the workspace and
a scratch directory; seccomp refuses sockets.

Then: fork a child that puts itself in a new process group, dies with this process, sets
its resource limits (address space, CPU seconds, file size, processes, open files, no core
dumps), drops every capability, confines itself (seccomp; Landlock in ``exec`` mode) and
``execve``\\ s the shell on the command. This process reads stdout and stderr (the first and
last ``max_output_bytes / 2`` of each are kept, a flood of more than
``KILL_AFTER_OUTPUT_LIMITS`` times that kills the command), enforces the wall-clock timeout,
then kills the process group and, in ``namespaces`` mode, every other process of the
namespace (``setsid`` and double-forked escapees included).

A spec with ``tunnels`` (``[[port, socket path inside], ...]``, namespaces mode only; see
:mod:`roll_core.sandbox.tunnel`): before the command starts, PID 1 brings the namespace's
loopback up, listens on ``127.0.0.1:port`` and forks the forwarder, which drops every
capability and relays each connection to the unix socket, the sandbox's one way out. It is a
process of the namespace, so it ends with the command like everything else there.
"""

import contextlib
import fcntl
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import time

KILL_AFTER_OUTPUT_LIMITS = 16
START_FAILED = 72


class Capture:
    """The head and tail of one output stream, and how many bytes passed."""

    def __init__(self, cap):
        self.half = max(1, cap // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk):
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    @property
    def truncated(self):
        return self.total > len(self.head) + len(self.tail)

    def text(self):
        head = self.head.decode("utf-8", "replace")
        if not self.truncated:
            return head + self.tail.decode("utf-8", "replace")
        skipped = self.total - len(self.head) - len(self.tail)
        note = f"\n[... {skipped} bytes of output cut ...]\n"
        return head + note + self.tail.decode("utf-8", "replace")


def set_exec_limits(spec):
    limits = [
        (resource.RLIMIT_AS, spec["memory_mb"] << 20),
        (resource.RLIMIT_CPU, spec["cpu_s"]),
        (resource.RLIMIT_FSIZE, spec["max_file_mb"] << 20),
        (resource.RLIMIT_NOFILE, spec["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if spec["mode"] == "namespaces":  # counted per user namespace: this sandbox only
        limits.append((resource.RLIMIT_NPROC, spec["max_processes"]))
    for which, value in limits:
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU, then SIGKILL
        resource.setrlimit(which, (value, hard))


def exec_command(lib, spec, parent):
    """In the forked child: confine, then become the shell (never returns)."""
    try:
        os.setpgid(0, 0)
        os.closerange(3, 1 << 16)
        os.chdir(spec["cwd"])
        set_exec_limits(spec)
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(START_FAILED)
        if spec["mode"] == "namespaces":
            drop_capabilities(lib)
            install_seccomp(lib, "namespaces", os.getpid())
        else:
            readable = spec["binds"] + ["/dev/urandom", "/dev/zero"]
            writable = [spec["cwd"], spec["work_dir"], "/dev/null"]
            if landlock_restrict(lib, readable, writable) == 0 and spec["require_landlock"]:
                raise OSError("Landlock is unavailable on this kernel")
            install_seccomp(lib, "exec", os.getpid())
        shell = spec["shell"]
        os.execve(shell, [shell, "-c", spec["command"]], spec["env"])
    except BaseException as err:
        os.write(2, f"sandbox: cannot start the command: {err!r}\n".encode())
    os._exit(START_FAILED)


def start_command(lib, spec):
    path = os.path.join(spec["work_dir"], ".stdin-" + spec["nonce"])
    stdin_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)  # the command's own input: an open, already unlinked file
    view = memoryview(spec["stdin"].encode("utf-8"))
    while view:
        view = view[os.write(stdin_fd, view) :]
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        for src, dst in ((stdin_fd, 0), (out_w, 1), (err_w, 2)):
            os.dup2(src, dst)
        exec_command(lib, spec, parent)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    return pid, out_r, err_r


def pump(pid, streams, deadline, flood):
    """Read the command's pipes until it exits and they drain, the deadline, or a flood."""
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    wstatus, exited = 0, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout", wstatus, exited
        events = poller.poll(min(left, 0.05) * 1000) if streams else time.sleep(min(left, 0.01))
        for fd, _ in events or ():
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poller.unregister(fd)
                os.close(fd)
                del streams[fd]
                continue
            streams[fd].add(chunk)
            if sum(c.total for c in streams.values()) > flood:
                return "flood", wstatus, exited
        if exited and not events:
            return None, wstatus, exited
        if not exited:
            done, wstatus = os.waitpid(pid, os.WNOHANG)
            exited = done != 0
            if exited and not streams:
                return None, wstatus, exited


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
FORWARDER_CONNECTIONS = 64


def loopback_up():
    """Bring up the namespace's ``lo`` (PID 1 holds CAP_NET_ADMIN over its namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def relay(src, dst):
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def forward_one(conn, path, slots):
    try:
        with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as out:
            out.connect(path)
            back = threading.Thread(target=relay, args=(out, conn), daemon=True)
            back.start()
            relay(conn, out)
            back.join()
    except OSError:
        pass
    finally:
        slots.release()


def start_forwarder(lib, port, path):
    """Listen on ``127.0.0.1:port`` here and fork the forwarder to ``path`` (a unix socket)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(FORWARDER_CONNECTIONS)
    pid = os.fork()
    if pid:
        listener.close()
        return pid
    try:
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        keep = {0, 1, 2, listener.fileno()}
        for fd in range(3, 1 << 10):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        drop_capabilities(lib)
        slots = threading.BoundedSemaphore(FORWARDER_CONNECTIONS)
        while True:
            conn, _ = listener.accept()
            slots.acquire()
            threading.Thread(target=forward_one, args=(conn, path, slots), daemon=True).start()
    finally:
        os._exit(0)


def cpu_spent(spec):
    """Whether the command's children used up their CPU limit (SIGKILL at the hard one)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime >= spec["cpu_s"]


def run_command(lib, spec):
    start = time.monotonic()
    pid, out_r, err_r = start_command(lib, spec)
    cap = spec["max_output_bytes"]
    out, err = Capture(cap), Capture(cap)
    streams = {out_r: out, err_r: err}
    flood = cap * KILL_AFTER_OUTPUT_LIMITS
    stop, wstatus, exited = pump(pid, streams, start + spec["timeout"], flood)
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
    if code == START_FAILED and err.head.startswith(b"sandbox: cannot start the command"):
        fail(err.text().strip())  # a broken sandbox, not a failing command
    timed_out = (
        stop == "timeout" or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or cpu_spent(spec)
    )
    return {
        "exit_code": code,
        "stdout": out.text(),
        "stderr": err.text(),
        "truncated": out.truncated or err.truncated or stop == "flood",
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }


def main():
    lib = libc()
    setup = json.loads(sys.argv[1])  # mode and uid only
    if setup["mode"] == "namespaces":
        enter_user_namespace(lib, setup)
    nondumpable(lib)
    spec = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if spec["mode"] == "namespaces":
        enter_namespaces(lib, spec)
        if spec.get("tunnels"):
            try:
                loopback_up()
                for port, path in spec["tunnels"]:
                    start_forwarder(lib, port, path)
            except OSError as err:
                fail(f"sandbox setup: the way out (tunnel) failed: {err}")
    else:
        enter_rlimits(lib, spec)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    result = run_command(lib, spec)
    result["nonce"] = spec["nonce"]
    view = memoryview(json.dumps(result).encode() + b"\n")
    while view:
        view = view[os.write(1, view) :]
    os._exit(0)


main()
