"""Workers in their own process under the `local` executor (no Ray).

Ranks that form a torch.distributed group cannot share the driver's process, so the local
executor starts each in a spawned subprocess and talks to it over a pipe: requests and
results travel as cloudpickle bytes (so worker classes defined anywhere, tests included,
cross over). Calls to one rank run in order; every call returns a `concurrent.futures.Future`.

A rank never outlives the driver: a driver that exits closes its ranks, and one killed by
SIGKILL (nothing of it runs to close them) takes them with it. On Linux the kernel sends the
rank SIGKILL when the driver thread that started it ends (`prctl(PR_SET_PDEATHSIG)`); ranks
started from another thread than the driver's main one (whose end must not kill them), and
other systems, watch the parent's pid from a thread instead. A rank in the middle of a step or
of a collective whose peer is gone would otherwise run on for as long as that takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cloudpickle

from roll_core.errors import RollError, WorkerDiedError

_STOP = "__stop__"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_S = 0.5
"""How often a rank without PR_SET_PDEATHSIG checks that its driver is still there."""


class WorkerProcessError(RuntimeError):
    """A worker subprocess raised an error that is not a RollError, or died."""


def _die_with_parent(parent: int, kernel: bool) -> None:  # runs in the child
    """End this process when `parent` (the driver) ends, however it ends (module docstring).

    `kernel`: the driver started us from its main thread, so the kernel's parent-death signal
    fires exactly when the driver process ends."""
    if kernel and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        kernel = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    else:
        kernel = False
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)
    if not kernel:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(_WATCH_S)
            os._exit(1)

        threading.Thread(target=watch, name="roll-watch-driver", daemon=True).start()


def _serve(conn: Any, payload: bytes, parent: int, kernel: bool) -> None:  # runs in the child
    _die_with_parent(parent, kernel)
    # Ctrl-C in a terminal reaches the whole process group: the driver decides how to stop
    # (finish the step, save, then close us), so the ranks ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker = None
    try:
        worker_cls, kwargs = cloudpickle.loads(payload)
        worker = worker_cls(**kwargs)
        conn.send_bytes(cloudpickle.dumps(("ok", None)))
    except BaseException as err:  # noqa: BLE001 - reported to the driver
        conn.send_bytes(_error(err))
        return
    while True:
        try:
            method, args, kwargs = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver closed the pipe, or is gone
            return
        if method == _STOP:
            conn.send_bytes(cloudpickle.dumps(("ok", None)))
            return
        try:
            result = worker.call(method, *args, **kwargs)
            reply = cloudpickle.dumps(("ok", result))
        except BaseException as err:  # noqa: BLE001 - reported to the driver
            reply = _error(err)
        try:
            conn.send_bytes(reply)
        except OSError:  # the driver is gone: nobody to answer
            return


def _error(err: BaseException) -> bytes:
    """The error as the driver should see it: a RollError as itself (the user's mistake),
    anything else as a WorkerProcessError carrying the child's traceback."""
    if isinstance(err, RollError):
        try:
            cloudpickle.loads(cloudpickle.dumps(err))
            return cloudpickle.dumps(("err", err))
        except Exception:  # noqa: BLE001 - fall back to text
            pass
    text = "".join(traceback.format_exception(err))
    return cloudpickle.dumps(("err", WorkerProcessError(f"worker process failed:\n{text}")))


def chain_future(fut: Future, translate: Any) -> Future:
    """A Future with `fut`'s result, or its exception passed through `translate`."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            out.cancel()
            return
        err = f.exception()
        if err is None:
            out.set_result(f.result())
        else:
            out.set_exception(translate(err))

    out.set_running_or_notify_cancel()
    fut.add_done_callback(done)
    return out


def exit_reason(code: int | None) -> str:
    """`exited with code 1`, `was killed by SIGKILL`, ... for a process's exit code."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ": often the kernel's out-of-memory killer, or a kill by hand" if code == -9 else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class ProcessHandle:
    """One rank in a spawned subprocess."""

    def __init__(self, worker_cls: type, kwargs: dict[str, Any], *, env: dict[str, str]) -> None:
        module = sys.modules.get(worker_cls.__module__)
        if module is not None and not worker_cls.__module__.startswith("roll_core"):
            # e.g. a test module that a fresh interpreter cannot import by name: send the
            # class by value
            cloudpickle.register_pickle_by_value(module)
        self.rank = int(kwargs.get("rank", 0))
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # inherited by the child at start
        try:
            payload = cloudpickle.dumps((worker_cls, kwargs))
            main = threading.current_thread() is threading.main_thread()
            self._proc = ctx.Process(
                target=_serve, args=(child, payload, os.getpid(), main), daemon=True
            )
            self._proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roll-proc")
        self._started = self._pool.submit(self._receive)

    def _receive(self) -> Any:
        try:
            status, value = cloudpickle.loads(self._conn.recv_bytes())
        except (EOFError, ConnectionResetError, OSError):
            self._proc.join(5)  # reap it, for its exit code
            raise WorkerDiedError(
                "", self.rank, f"process {self._proc.pid} {exit_reason(self._proc.exitcode)}"
            ) from None
        if status == "err":
            raise value
        return value

    def _roundtrip(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        self._started.result()
        self._conn.send_bytes(cloudpickle.dumps((method, args, kwargs)))
        return self._receive()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(self._roundtrip, method, args, kwargs)

    submit_async = submit

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(Exception):  # the process is ended below either way
                self.submit(_STOP).result(timeout=timeout)
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._pool.shutdown(wait=False)
        self._conn.close()
