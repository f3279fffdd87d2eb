"""The futures protocol of the Tinker API: a mutating call answers at once with a
``request_id``; the client polls ``retrieve_future`` until the result is ready.

Training requests run one at a time on one worker thread: each model's in arrival order (the
client numbers them), the models in turn (round robin: a client with many requests queued does
not hold back another's). Sampling requests run on their own threads (the engine batches them).
``retrieve_future`` waits up to :data:`POLL_S` for a result, then answers ``try_again``; a
failed request answers Tinker's ``RequestFailedResponse`` (``error``, ``category``), so the
client raises at once rather than retrying.
"""

from __future__ import annotations

import itertools
import threading
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from roll_core.errors import RollError
from roll_core.serve.trainer import UserError

POLL_S = 20.0
"""Longest wait of one ``retrieve_future`` call (the client's own timeout is 45 s)."""


@dataclass
class Result:
    """A finished request: JSON (`body` a dict) or protobuf (`body` bytes)."""

    body: dict[str, Any] | bytes


class Futures:
    """Request ids -> their futures, the training queue and the sampling threads."""

    def __init__(self, sample_threads: int = 16) -> None:
        self._futures: dict[str, Future[Result]] = {}
        self._owner: dict[str, str] = {}
        self._lock = threading.Lock()
        # training requests per model, in arrival order; the worker takes one from each model
        # that has some, in turn (round robin), so no client waits behind another's backlog
        self._queues: dict[str, deque[tuple[Future[Result], Callable[[], Result]]]] = {}
        self._turn: deque[str] = deque()
        self._ready = threading.Condition(self._lock)
        self._closed = False
        self._counter = itertools.count(1)
        self._worker = threading.Thread(target=self._run, name="serve-train", daemon=True)
        self._worker.start()
        self._pool = ThreadPoolExecutor(max_workers=sample_threads, thread_name_prefix="serve-s")

    def _new(self, session: str) -> tuple[str, Future[Result]]:
        rid = f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        fut: Future[Result] = Future()
        with self._lock:
            self._futures[rid] = fut
            self._owner[rid] = session
        return rid, fut

    def submit_train(self, session: str, model: str, work: Callable[[], Result]) -> str:
        """Queue `work` behind the requests already queued for `model` (a model id)."""
        rid, fut = self._new(session)
        with self._ready:
            if model not in self._queues:
                self._queues[model] = deque()
                self._turn.append(model)
            self._queues[model].append((fut, work))
            self._ready.notify()
        return rid

    def _next(self) -> tuple[Future[Result], Callable[[], Result]] | None:
        """The next training request: the first of the model whose turn it is."""
        with self._ready:
            while not self._turn and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            model = self._turn.popleft()
            pending = self._queues[model]
            item = pending.popleft()
            if pending:
                self._turn.append(model)  # its next request waits for the others' turns
            else:
                del self._queues[model]
            return item

    def submit_sample(self, session: str, work: Callable[[], Result]) -> str:
        rid, fut = self._new(session)
        self._pool.submit(_settle, fut, work)
        return rid

    def _run(self) -> None:
        while (item := self._next()) is not None:
            _settle(*item)

    def retrieve(self, rid: str, wait_s: float = POLL_S) -> dict[str, Any] | bytes | None:
        """The result of `rid` (body), a failure body, or None while it runs (try again).
        KeyError: no such request."""
        with self._lock:
            fut = self._futures[rid]
        try:
            result = fut.result(timeout=wait_s)
        except FutureTimeout:
            return None
        except CancelledError:
            return {"error": f"request {rid} was cancelled", "category": "user"}
        except UserError as err:
            return {"error": str(err), "category": "user"}
        except RollError as err:  # a model, checkpoint or setting roll refuses: said in full
            text = f"{err.message} {err.hint}" if err.hint else err.message
            return {"error": text, "category": "user"}
        except Exception as err:  # a bug in roll: say so, and where
            tb = traceback.format_exception_only(type(err), err)[-1].strip()
            return {"error": f"internal error in roll serve: {tb}", "category": "server"}
        return result.body

    def cancel(self, rid: str) -> bool:
        with self._lock:
            fut = self._futures.get(rid)
        return fut is not None and fut.cancel()

    def forget_session(self, session: str) -> None:
        """Cancel what a closed session still has queued."""
        with self._lock:
            rids = [r for r, s in self._owner.items() if s == session]
        for rid in rids:
            self.cancel(rid)

    def close(self) -> None:
        """Cancel what is queued; the running training request and samples go on (see
        :meth:`join`)."""
        with self._ready:
            self._closed = True
            pending = [fut for queue in self._queues.values() for fut, _ in queue]
            self._queues.clear()
            self._turn.clear()
            self._ready.notify_all()
        for fut in pending:
            fut.cancel()  # its client reads "cancelled", not a wait that never ends
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        """Wait for the running training request and samples to finish (after :meth:`close`)."""
        self._worker.join()
        self._pool.shutdown(wait=True)


def _settle(fut: Future[Result], work: Callable[[], Result]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(work())
    except BaseException as err:  # the client reads it through retrieve_future
        fut.set_exception(err)
