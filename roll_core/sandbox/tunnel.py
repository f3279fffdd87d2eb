"""A sandbox's one way out: a TCP port inside its network namespace, relayed to one host address.

A harness inside a sandbox has no network: its network namespace holds only a loopback
interface. To let it call the episode's endpoint (``127.0.0.1:PORT`` on the host, which the
sandbox cannot see), :meth:`roll_core.sandbox.local.LocalSandbox.exec` with a
:class:`~roll_core.sandbox.base.Tunnel` builds this path, for that command only::

    harness --TCP--> 127.0.0.1:<tunnel.port>          inside the sandbox: the forwarder, a
                     (the namespace's loopback)        process of the sandbox's PID namespace
            --unix--> /run/roll/way-out.sock           a socket file bind-mounted read-only
                     (a private directory on the host)
            --TCP--> tunnel.target                     the host side: :class:`HostRelay`

:class:`HostRelay` (this module) listens on the unix socket and connects each connection to
the one target address it was given; nothing a sandboxed process sends can choose another
address. The forwarder inside (:func:`roll_core.sandbox._exec_supervisor.start_forwarder`)
connects only to the socket. So the sandbox reaches exactly one host address (the endpoint
server, whose sessions are named by unguessable tokens: an episode reaches its own session),
every other host port and the outside network stay unreachable, and the path ends with the
command (the forwarder dies with the namespace, the relay is closed by ``exec``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

__all__ = ["HostRelay", "SOCKET_INSIDE"]

SOCKET_NAME = "way-out.sock"
DIR_INSIDE = "/run/roll"
SOCKET_INSIDE = f"{DIR_INSIDE}/{SOCKET_NAME}"
MAX_PARENT = 60  # longest parent directory of the socket's own directory
MAX_CONNECTIONS = 64  # open at once; more wait in the listen backlog
_CHUNK = 1 << 16


class HostRelay:
    """Relays connections on a unix socket in ``directory`` to ``target`` (host, port).

    Args:
        parent: where the socket's own directory is made (a sandbox's private directory; the
            system's temporary directory when that path is too long for a unix socket).
        target: the one address connections reach.
        uid: the host uid of the sandboxed processes (when roll runs as root), who must be
            able to connect to the socket.
    """

    def __init__(self, parent: Path, target: tuple[str, int], uid: int | None = None) -> None:
        self.target = (str(target[0]), int(target[1]))
        if len(str(parent)) > MAX_PARENT:  # sun_path holds 108 bytes
            parent = Path(tempfile.gettempdir())
        self.directory = Path(tempfile.mkdtemp(prefix="roll-way-out-", dir=parent))
        self.directory.chmod(0o711)
        self.path = self.directory / SOCKET_NAME
        self.connections = 0
        """Connections relayed so far (a harness that never reached the endpoint has 0)."""
        self._closed = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.server.bind(str(self.path))
            if uid is not None:
                os.chown(self.path, uid, uid, follow_symlinks=False)
            os.chmod(self.path, 0o600)  # only the sandbox's uid (or roll's own) connects
            self.server.listen(MAX_CONNECTIONS)
        except OSError:
            self.server.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.thread = threading.Thread(target=self._accept, name="sandbox-relay", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.server.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(timeout=30):
                inner.close()
                continue
            with self._lock:
                if self._closed:
                    inner.close()
                    self._slots.release()
                    return
                self.connections += 1
                self._open.add(inner)
            threading.Thread(target=self._serve, args=(inner,), daemon=True).start()

    def _serve(self, inner: socket.socket) -> None:
        outer: socket.socket | None = None
        try:
            outer = socket.create_connection(self.target, timeout=10)
            outer.settimeout(None)
            with self._lock:
                if self._closed:
                    return
                self._open.add(outer)
            back = threading.Thread(target=_pump, args=(outer, inner), daemon=True)
            back.start()
            _pump(inner, outer)
            back.join()
        except OSError:
            pass
        finally:
            for sock in (inner, outer):
                if sock is not None:
                    with self._lock:
                        self._open.discard(sock)
                    sock.close()
            self._slots.release()

    def close(self) -> None:
        """Stop accepting, cut every open connection, remove the socket; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_now = list(self._open)
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=5)
        shutil.rmtree(self.directory, ignore_errors=True)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until end of stream, then half-close ``dst``."""
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
