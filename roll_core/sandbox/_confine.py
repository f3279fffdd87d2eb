"""Kernel confinement of one sandboxed program: a seccomp filter and a Landlock ruleset.

Part of a sandbox supervisor's source (:func:`roll_core.sandbox.supervisor.supervisor_source`
puts this file first, for the code reward's and the SWE sandbox's supervisors); standard
library only, never imported by roll. Both are applied in the program's child process after ``fork`` and
before ``execve``, after ``no_new_privs``, so an unprivileged process may install them and
neither the program nor anything it starts can remove them.

``seccomp_filter(mode, pid)`` builds a classic-BPF program (x86_64 and aarch64):

* both modes: no ``ptrace``, ``process_vm_readv/writev``, ``pidfd_*``, ``io_uring`` (its
  operations bypass seccomp), ``bpf``, ``perf_event_open``, ``userfaultfd``, key rings,
  mount API, ``unshare``/``setns``/``chroot``, ``open_by_handle_at``;
* ``rlimits`` also: no new processes (``fork``/``vfork``/``clone`` without ``CLONE_THREAD``
  fail with ``EAGAIN``; ``clone3`` is ``ENOSYS`` so the C library falls back to ``clone``
  for threads), no signal to any other process (``kill`` only to itself or its own process
  group, ``tgkill`` only to its own threads; no ``tkill``, ``rt_*sigqueueinfo``, no
  ``F_SETOWN``/``F_SETSIG``/``FIOSETOWN``/``SIOCSPGRP`` SIGIO redirection), and no
  ``socket`` at all (``socketpair`` stays);
* ``exec`` (the SWE sandbox without namespaces: a shell must start processes): the common
  list and no ``socket``.

``landlock_restrict(read_paths, write_paths)`` (Linux >= 5.13 with Landlock enabled; a no-op
returning the ABI 0 where it is not): the program may read and execute beneath
``read_paths``, do anything beneath ``write_paths``, and nothing else on the file system
(no ``/proc``, no ``/tmp``, no home directory); ABI >= 4 also denies TCP bind/connect,
ABI >= 6 signals to processes outside the sandbox and abstract UNIX sockets.
"""

import ctypes
import errno
import os
import platform
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_ERRNO, RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
CLONE_THREAD = 0x00010000
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902

ARCHES = {
    "x86_64": 0xC000003E,
    "aarch64": 0xC00000B7,
}
COMMON = {  # name: (x86_64, aarch64); denied in both modes
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
}
RLIMITS_ONLY = {  # name: (x86_64, aarch64); -1: no such call there
    "fork": (57, -1),
    "vfork": (58, -1),
    "clone": (56, 220),
    "clone3": (435, 435),
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "socket": (41, 198),
    "fcntl": (72, 25),
    "ioctl": (16, 29),
}
SYSCALLS = {**COMMON, **RLIMITS_ONLY}


def _insn(code, jt, jf, k):
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _arg_lo(i):
    return 16 + 8 * i  # seccomp_data.args[i], low 32 bits (little-endian)


def seccomp_filter(mode, pid):
    """The BPF program (bytes) for ``mode``; ``pid``: the program's own pid."""
    machine = platform.machine()
    if machine not in ARCHES:
        raise OSError(f"no seccomp filter for the {machine} architecture")
    col = 0 if machine == "x86_64" else 1
    nr = {name: numbers[col] for name, numbers in SYSCALLS.items()}
    eperm = RET_ERRNO | errno.EPERM
    prog = [_insn(LD_ABS, 0, 0, 4), _insn(JEQ, 1, 0, ARCHES[machine]), _insn(RET, 0, 0, RET_KILL)]
    prog.append(_insn(LD_ABS, 0, 0, 0))
    if machine == "x86_64":  # the x32 ABI: other numbers for the same calls
        prog += [_insn(JGE, 0, 1, 0x40000000), _insn(RET, 0, 0, eperm)]
    deny = {name: eperm for name in COMMON}
    if mode == "exec":
        deny["socket"] = RET_ERRNO | errno.EACCES
    if mode == "rlimits":
        deny.update(
            fork=RET_ERRNO | errno.EAGAIN,
            vfork=RET_ERRNO | errno.EAGAIN,
            clone3=RET_ERRNO | errno.ENOSYS,
            tkill=eperm,
            rt_sigqueueinfo=eperm,
            rt_tgsigqueueinfo=eperm,
            socket=RET_ERRNO | errno.EACCES,
        )
    for name, action in deny.items():
        if nr[name] >= 0:
            prog += [_insn(JEQ, 0, 1, nr[name]), _insn(RET, 0, 0, action)]
    if mode == "rlimits":
        # clone: threads only
        prog += [
            _insn(JEQ, 0, 4, nr["clone"]),
            _insn(LD_ABS, 0, 0, _arg_lo(0)),
            _insn(JSET, 1, 0, CLONE_THREAD),
            _insn(RET, 0, 0, RET_ERRNO | errno.EAGAIN),
            _insn(RET, 0, 0, RET_ALLOW),
        ]
        # kill(0 or self), tgkill(self, ...): anything else is EPERM
        for name, allowed in (("kill", (0, pid)), ("tgkill", (pid, pid))):
            prog += [
                _insn(JEQ, 0, 5, nr[name]),
                _insn(LD_ABS, 0, 0, _arg_lo(0)),
                _insn(JEQ, 2, 0, allowed[0]),
                _insn(JEQ, 1, 0, allowed[1]),
                _insn(RET, 0, 0, eperm),
                _insn(RET, 0, 0, RET_ALLOW),
            ]
        for name, cmds in (
            ("fcntl", (F_SETOWN, F_SETSIG, F_SETOWN_EX)),
            ("ioctl", (FIOSETOWN, SIOCSPGRP)),
        ):
            block = [_insn(LD_ABS, 0, 0, _arg_lo(1))]
            for i, cmd in enumerate(cmds):
                block.append(_insn(JEQ, len(cmds) - i, 0, cmd))
            block += [_insn(RET, 0, 0, RET_ALLOW), _insn(RET, 0, 0, eperm)]
            prog += [_insn(JEQ, 0, len(block), nr[name])] + block
    prog.append(_insn(RET, 0, 0, RET_ALLOW))
    return b"".join(prog)


def install_seccomp(lib, mode, pid):
    """Install the filter on the calling thread (after ``no_new_privs``)."""
    code = seccomp_filter(mode, pid)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(code) // 8, code)
    if lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "no_new_privs failed")
    if lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "installing the seccomp filter failed")


SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD, SYS_LANDLOCK_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)


def landlock_abi(lib):
    """The Landlock ABI version of this kernel (0: unavailable)."""
    lib.syscall.restype = ctypes.c_long
    abi = lib.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1)
    )
    return max(0, int(abi))


def landlock_restrict(lib, read_paths, write_paths):
    """Confine the calling thread's file access (see the module docstring); returns the ABI
    used (0: Landlock unavailable, nothing done). Raises OSError when a step fails."""
    abi = landlock_abi(lib)
    if abi == 0:
        return 0
    handled = (1 << 13) - 1
    handled |= (1 << 13) if abi >= 2 else 0
    handled |= (1 << 14) if abi >= 3 else 0
    handled |= (1 << 15) if abi >= 5 else 0
    attr = struct.pack("=QQQ", handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = lib.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE), buf, ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    try:
        for paths, rights in ((read_paths, read), (write_paths, handled)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # not on this system
                try:
                    allowed = rights & handled
                    if not os.path.isdir(path):
                        allowed &= FS_FILE_RIGHTS
                    rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                    result = lib.syscall(
                        ctypes.c_long(SYS_LANDLOCK_ADD),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(1),
                        rule,
                        ctypes.c_uint32(0),
                    )
                    if result != 0:
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
                finally:
                    os.close(fd)
        if lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "no_new_privs failed")
        result = lib.syscall(
            ctypes.c_long(SYS_LANDLOCK_RESTRICT), ctypes.c_int(ruleset), ctypes.c_uint32(0)
        )
        if result != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi
