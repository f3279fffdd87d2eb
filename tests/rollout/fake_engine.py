"""A fake request-level inference rank for router and scheduler tests: the methods of
ActorInfer's RequestEngine surface, with no model. A request's response is decided by its
seed: ``length = 1 + seed % max_new_tokens`` tokens (unless the test sets ``lengths`` by
request id), token i is ``100 + (seed + i) % 50`` (continuing a prefix, i counts from the
prefix's end), its log-prob ``-(i + 1) / 100``; each token takes ``token_s`` seconds, so
requests finish after a per-request delay. ``die`` names request ids whose call kills the rank
(the call raises WorkerDiedError, and so does every later call to that rank); ``hang`` names
request ids that never finish unless aborted; ``start_delay`` is how long a request takes to
reach the engine (an abort that arrives before it is ignored, as engines do)."""

from __future__ import annotations

import threading
import time
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.errors import WorkerDiedError


def token(seed: int, i: int) -> int:
    return 100 + (seed + i) % 50


class FakeEngine(Worker):
    def __init__(
        self,
        *,
        token_s: float = 0.002,
        lengths: dict[int, int] | None = None,
        die: tuple[int, ...] = (),
        hang: tuple[int, ...] = (),
        start_delay: float = 0.0,
        **rank_info: Any,
    ) -> None:
        super().__init__(**rank_info)
        self.token_s = token_s
        self.lengths = dict(lengths or {})
        self.die = set(die)
        self.hang = set(hang)
        self.start_delay = start_delay  # before a request is registered (aborts miss it)
        self.version = 0
        self.dead = False
        self.lock = threading.Lock()
        self.aborts: dict[int, threading.Event] = {}
        self.served: list[int] = []  # request ids in the order they arrived
        self.batches: list[list[int]] = []  # generate(): the ids of each fixed batch
        self.running = threading.Event()
        self.running.set()

    def _length(self, request: Request, params: SamplingParams) -> int:
        total = self.lengths.get(request.request_id, 1 + request.seed % params.max_new_tokens)
        return max(0, min(total - len(request.prefix_ids), params.max_new_tokens))

    def _check(self, request: Request) -> None:
        if request.request_id in self.die:
            self.dead = True
        if self.dead:
            raise WorkerDiedError("", self.rank, "killed by the test")

    @dispatch("one", concurrent=True)
    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        time.sleep(self.start_delay)
        with self.lock:
            self.served.append(request.request_id)
            event = self.aborts.setdefault(request.request_id, threading.Event())
        self._check(request)
        length = self._length(request, params)
        start = len(request.prefix_ids)
        ids: list[int] = []
        reason = "length" if length == params.max_new_tokens else "stop"
        while len(ids) < length or request.request_id in self.hang:
            self.running.wait()
            if event.wait(self.token_s):
                reason = "abort"
                break
            if request.request_id not in self.hang:
                ids.append(token(request.seed, start + len(ids)))
        with self.lock:
            self.aborts.pop(request.request_id, None)
        lps = [-(start + i + 1) / 100 for i in range(len(ids))]
        return Completion(request.request_id, ids, lps, reason, self.version)

    @dispatch("one")
    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        self.batches.append([r.request_id for r in requests])
        for r in requests:
            self._check(r)
        out = []
        for r in requests:
            n = self._length(r, params)
            start = len(r.prefix_ids)
            ids = [token(r.seed, start + i) for i in range(n)]
            lps = [-(start + i + 1) / 100 for i in range(n)]
            reason = "length" if n == params.max_new_tokens else "stop"
            out.append(Completion(r.request_id, ids, lps, reason, self.version))
        time.sleep(self.token_s * max((self._length(r, params) for r in requests), default=0))
        return out

    @dispatch("all", concurrent=True)
    def abort_requests(self, request_ids: list[int]) -> None:
        with self.lock:
            for rid in request_ids:
                if rid in self.aborts:
                    self.aborts[rid].set()

    @dispatch("all", concurrent=True)
    def pause_generation(self) -> None:
        self.running.clear()

    @dispatch("all", concurrent=True)
    def resume_generation(self) -> None:
        self.running.set()

    @dispatch("all")
    def set_version(self, version: int) -> None:
        self.version = version

    @dispatch("all")
    def served_ids(self) -> list[int]:
        with self.lock:
            return list(self.served)

    @dispatch("all")
    def batch_ids(self) -> list[list[int]]:
        return [list(b) for b in self.batches]
