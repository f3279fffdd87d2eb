"""Running reward functions under a hard wall-clock bound, from many threads at once.

The rollout scheduler scores each response as soon as it finishes, from several threads. A
reward function may raise, return garbage, or never return (SymPy on a pathological
expression, a user function stuck on I/O); none of this may stop the run. math-verify's own
timeout uses ``signal.alarm``, which only works in the main thread, so it is switched off
and the bound is enforced here instead, in one of two ways:

* :class:`ProcessRunner` (default): a small pool of worker processes. A call sends the sample
  down a pipe and waits at most ``timeout_s`` for the answer; a worker that overruns is
  killed (with any processes it started: each worker is its own process group) and replaced
  at once. Workers are fresh interpreters (``python -m roll_core.rewards._worker``), never a
  ``fork`` of a driver that runs threads, torch or Ray, and never a re-import of the
  driver's ``__main__`` (what ``multiprocessing``'s spawn and forkserver do); they get the
  driver's ``sys.path`` and the pickled reward functions once, at start-up, import and warm
  them (math-verify: about 0.5 s), then serve samples. A worker exits when the driver goes
  away, even in the middle of a stuck call. We do not use
  :class:`concurrent.futures.ProcessPoolExecutor` because it cannot kill one stuck task: a
  timed-out future keeps its worker busy forever.
* :class:`ThreadRunner`: each call runs in a daemon thread of this process (reused); the caller
  stops waiting after ``timeout_s``. For functions that cannot be pickled or that hold a big
  object (a judge model). A Python thread cannot be killed, so an overrunning call keeps
  running in the background (:meth:`ThreadRunner.stuck` counts them).

Both return an :class:`Outcome`; neither raises for a failing reward function.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from roll_core.rewards.base import RewardFn, RewardResult, RewardSample, as_result

__all__ = ["Outcome", "ProcessRunner", "ThreadRunner", "describe_error"]


@dataclass(frozen=True)
class Outcome:
    """What one bounded call produced: a result, or why there is none.

    Attributes:
        result: the reward, or None when the call failed or timed out.
        error: None, or a one-line reason (``"ValueError: ..."``, ``"timed out after 5 s"``).
        timed_out: the call overran its bound.
        seconds: wall time of the call itself (queueing for a free worker excluded).
    """

    result: RewardResult | None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


def describe_error(err: BaseException, limit: int = 500) -> str:
    """``"TypeName: message"`` on one line, at most ``limit`` characters."""
    text = f"{type(err).__name__}: {err}".replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_fn(fns: Mapping[str, RewardFn], key: str, sample: RewardSample) -> RewardResult:
    """Call the function under ``key`` and check what it returned."""
    return as_result(fns[key](sample), source=f"reward of domain {key!r}")


def warm(fns: Mapping[str, RewardFn]) -> None:
    """Call ``warmup()`` on the functions that have one (imports, first parse)."""
    for fn in fns.values():
        warmup = getattr(fn, "warmup", None)
        if callable(warmup):
            warmup()


class _CallThread:
    """A daemon thread that runs the calls handed to it, one at a time, until told to stop
    (None). Reused across calls: starting a thread per call cost ~0.1 ms, which for 128
    cheap scores a step was most of the reward stage."""

    def __init__(self, name: str) -> None:
        self.calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def _loop(self) -> None:
        while (call := self.calls.get()) is not None:
            call()


class ThreadRunner:
    """Calls reward functions in daemon threads; the caller waits at most ``timeout_s``.
    Threads are reused; one whose call timed out is abandoned (it stops after that call)."""

    def __init__(self, fns: Mapping[str, RewardFn]) -> None:
        self._fns = dict(fns)
        self._abandoned: list[threading.Thread] = []
        self._idle: list[_CallThread] = []
        self._lock = threading.Lock()
        warm(self._fns)

    def run(self, key: str, sample: RewardSample, timeout_s: float) -> Outcome:
        """Score ``sample`` with the function registered under ``key``."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["result"] = call_fn(self._fns, key, sample)
            except BaseException as err:  # a reward function must never kill the caller
                box["error"] = describe_error(err)
            finally:
                done.set()

        with self._lock:
            worker = self._idle.pop() if self._idle else _CallThread(f"roll-reward-{key}")
        start = time.perf_counter()
        worker.calls.put(target)
        finished = done.wait(timeout_s)
        seconds = time.perf_counter() - start
        with self._lock:
            if finished:
                self._idle.append(worker)
            else:
                worker.calls.put(None)  # ends once the stuck call returns, if ever
                self._abandoned.append(worker.thread)
        if not finished:
            return Outcome(None, f"timed out after {timeout_s:g} s", True, seconds)
        if "error" in box:
            return Outcome(None, box["error"], False, seconds)
        return Outcome(box["result"], None, False, seconds)

    def stuck(self) -> int:
        """Calls that timed out and are still running in the background."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def close(self) -> None:
        """Stop the idle threads (stuck daemon threads end with the process)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.calls.put(None)


class _Worker:
    """One worker process (``python -m roll_core.rewards._worker``) and its two pipes."""

    def __init__(self, payload: bytes, sys_path: list[str]) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roll_core.rewards._worker",
                    str(to_child_r),
                    str(from_child_w),
                    str(os.getpid()),
                ],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: a kill takes its children too
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.ready = False
        with contextlib.suppress(OSError):  # died at once: wait_ready reports it
            write_frame(self._to_child, (sys_path, payload))

    def poll(self, timeout_s: float) -> bool:
        poller = select.poll()
        poller.register(self._from_child, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(max(0.0, timeout_s) * 1000.0))

    def recv(self) -> Any:
        return read_frame(self._from_child)

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(1)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.poll(timeout_s):
            raise RuntimeError(f"reward worker did not start within {timeout_s:g} s")
        try:
            tag, detail = self.recv()
        except EOFError:
            raise RuntimeError(
                f"reward worker exited while starting (exit code {self.exit_code()})"
            ) from None
        if tag != "ready":
            raise RuntimeError(f"reward worker failed to start: {detail}")
        self.ready = True

    def close_input(self) -> None:
        """Close the request pipe (an idle worker then exits); safe to call twice."""
        fd, self._to_child = self._to_child, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self.close_input()
        fd, self._from_child = self._from_child, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class ProcessRunner:
    """A pool of ``num_workers`` worker processes, each running one sample at a time.

    Args:
        fns: key (the domain) -> reward function; pickled once and sent to each worker when
            it starts (user functions travel as their dotted path and are imported there,
            with this process's ``sys.path`` as it is when the runner is created).
        num_workers: processes, started on first use; a killed one is replaced at once.
        start_timeout_s: how long a new worker may take to start (imports, warm-up); not
            part of any sample's timeout.

    Raises:
        TypeError, pickle.PicklingError, AttributeError: a function cannot be pickled
        (the router turns this into a ConfigError suggesting thread isolation).
    """

    def __init__(
        self, fns: Mapping[str, RewardFn], *, num_workers: int = 2, start_timeout_s: float = 120
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._payload = pickle.dumps(dict(fns), protocol=pickle.HIGHEST_PROTOCOL)
        self._sys_path = list(sys.path)  # where the functions were found importable
        self.num_workers = num_workers
        self._start_timeout_s = start_timeout_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._failed_starts = 0
        self._broken: str | None = None
        self.replaced = 0
        """Workers killed (timeout) or lost (crash) and replaced so far."""
        atexit.register(self.close)

    def _acquire(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward runner is closed")
            if len(self._workers) < self.num_workers:
                worker = _Worker(self._payload, self._sys_path)
                self._workers.add(worker)
                return worker
        while True:
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    raise RuntimeError("the reward runner is closed") from None

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            self.replaced += 1
            if self._closed:
                return
            fresh = _Worker(self._payload, self._sys_path)  # starts now, in the background
            self._workers.add(fresh)
        self._idle.put(fresh)

    def run(self, key: str, sample: RewardSample, timeout_s: float) -> Outcome:
        """Score ``sample`` with the function registered under ``key``, within ``timeout_s``."""
        for attempt in range(2):
            if self._broken is not None:
                return Outcome(None, self._broken)
            worker = self._acquire()
            if not worker.ready:
                try:
                    worker.wait_ready(self._start_timeout_s)
                except RuntimeError as err:
                    self._start_failed(str(err))
                    self._discard(worker)
                    return Outcome(None, str(err))
                with self._lock:
                    self._failed_starts = 0
            try:
                payload = pickle.dumps((key, sample), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as err:
                self._idle.put(worker)
                return Outcome(None, "cannot send the sample: " + describe_error(err))
            start = time.perf_counter()
            try:
                write_bytes(worker._to_child, payload)
            except OSError as err:  # it died while idle: retry once on a fresh one
                self._discard(worker)
                if attempt == 0:
                    continue
                return Outcome(None, "reward worker lost: " + describe_error(err))
            return self._wait(worker, timeout_s, start)
        raise AssertionError("unreachable")

    def _start_failed(self, reason: str) -> None:
        with self._lock:
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                # the same failure every time (a function the workers cannot import):
                # stop starting processes, fail every sample with the reason
                self._broken = f"{reason} ({self._failed_starts} workers in a row; gave up)"
                self._closed = True

    def _wait(self, worker: _Worker, timeout_s: float, start: float) -> Outcome:
        if not worker.poll(timeout_s):
            self._discard(worker)
            return Outcome(None, f"timed out after {timeout_s:g} s", True, timeout_s)
        try:
            tag, payload = worker.recv()
        except EOFError:
            code = worker.exit_code()
            self._discard(worker)
            return Outcome(None, f"the reward worker died (exit code {code})")
        except Exception as err:  # the reply was read whole but cannot be unpickled here
            self._idle.put(worker)
            return Outcome(None, "cannot read the result: " + describe_error(err))
        seconds = time.perf_counter() - start
        self._idle.put(worker)
        if tag == "ok":
            return Outcome(payload, None, False, seconds)
        return Outcome(None, str(payload), False, seconds)

    def close(self) -> None:
        """Stop every worker (idle ones exit cleanly, busy ones are killed). Idempotent."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            worker.close_input()  # end of input: an idle worker exits
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(0.5)
            worker.kill()
        atexit.unregister(self.close)


_HEADER = struct.Struct("!Q")
_MAX_FAILED_STARTS = 3


def write_bytes(fd: int, data: bytes) -> None:
    """Write one frame (8-byte length, then ``data``) to a pipe."""
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_frame(fd: int, message: object) -> None:
    """Pickle ``message`` and write it as one frame."""
    write_bytes(fd, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    """Read one frame and unpickle it; :class:`EOFError` when the other side is gone."""
    try:
        (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
        data = _read_exactly(fd, size)
    except OSError as err:
        raise EOFError(str(err)) from None
    return pickle.loads(data)
