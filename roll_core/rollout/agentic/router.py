"""The request router of agentic rollout: generation requests from every episode go to the
least-loaded inference rank in chunks (see :mod:`roll_core.rollout.agentic.manager`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.vision import VisionInputs
from roll_core.errors import RollError
from roll_core.rollout.agentic.episode import EpisodeCancelled


class Router:
    """Sends generation requests to the least-loaded inference rank in chunks."""

    def __init__(self, infer: Any, params: SamplingParams, chunk_size: int, max_chunks: int):
        self.infer = infer
        self.params = params
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self.cond = threading.Condition()
        self.queue: list[tuple[Request, SamplingParams, Future]] = []
        self.in_flight = [0] * infer.world_size
        self.chunks = [0] * infer.world_size
        self.paused = False
        self.closed = False
        self.gen_busy_s = 0.0
        self.calls = 0
        self._uid = 0
        self.thread = threading.Thread(target=self._loop, name="agentic-router", daemon=True)
        self.thread.start()

    def generate(
        self,
        prompt_ids: list[int],
        seed: int,
        params: SamplingParams | None = None,
        vision: VisionInputs | None = None,
    ) -> Future:
        """Queue one request (``vision``: the prompt's images, for a vision-language model)."""
        future: Future = Future()
        with self.cond:
            if self.closed:
                future.set_exception(EpisodeCancelled("router closed"))
                return future
            self._uid += 1
            request = Request(self._uid, prompt_ids, seed, vision=vision)
            self.queue.append((request, params or self.params, future))
            self.cond.notify_all()
        return future

    def _free_rank(self) -> int | None:
        free = [r for r in range(len(self.chunks)) if self.chunks[r] < self.max_chunks]
        return min(free, key=lambda r: (self.in_flight[r], r)) if free else None

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (
                    self.paused or not self.queue or self._free_rank() is None
                ):
                    self.cond.wait()
                if self.closed:
                    return
                rank = self._free_rank()
                assert rank is not None
                # requests of one chunk share sampling params (validation vs training)
                first = self.queue[0][1]
                chunk = [q for q in self.queue if q[1] == first and not q[2].cancelled()]
                chunk = chunk[: self.chunk_size]
                taken = {id(q) for q in chunk}
                self.queue = [q for q in self.queue if id(q) not in taken and not q[2].cancelled()]
                if not chunk:
                    continue
                self.in_flight[rank] += len(chunk)
                self.chunks[rank] += 1
            start = time.perf_counter()
            future = self.infer.submit(rank, "generate", [q[0] for q in chunk], first)
            future.add_done_callback(
                lambda f, rank=rank, chunk=chunk, start=start: self._done(f, rank, chunk, start)
            )

    def _done(self, future: Future, rank: int, chunk: list, start: float) -> None:
        error: BaseException | None = None
        by_id: dict[int, Completion] = {}
        try:
            by_id = {c.request_id: c for c in future.result()}
        except BaseException as err:  # noqa: BLE001 - handed to the waiting episodes
            cause = getattr(err, "cause", None)
            error = cause if isinstance(cause, RollError) else err
        with self.cond:
            self.in_flight[rank] -= len(chunk)
            self.chunks[rank] -= 1
            self.gen_busy_s += time.perf_counter() - start
            self.calls += 1
            self.cond.notify_all()
        for request, _, waiter in chunk:
            if not waiter.set_running_or_notify_cancel():
                continue  # the episode gave up waiting (cancelled)
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(by_id[request.request_id])

    def suspend(self) -> None:
        """Stop sending requests and wait until no chunk is in flight."""
        with self.cond:
            self.paused = True
            while sum(self.chunks) and not self.closed:
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            pending, self.queue = self.queue, []
            self.cond.notify_all()
        for _, _, waiter in pending:
            if waiter.set_running_or_notify_cancel():
                waiter.set_exception(EpisodeCancelled("router closed"))
