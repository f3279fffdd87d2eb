"""The one request router of rollout: every producer (the RLVR scheduler, synchronous or async,
and the agentic env manager) sends its generation requests through a :class:`Router`.

* **Streaming** (the default): each request goes on its own to one inference rank
  (``infer.at(rank).generate_request``, a continuously batching engine) and its future resolves
  the moment that request finishes; a short response never waits for a long one.
* **Deterministic** (``rollout.deterministic: true``): requests go in fixed chunks through the
  fixed-batch path (``infer.at(rank).generate``): a chunk's membership and order are what the
  producer made (:meth:`Router.submit_batch`, or consecutive :meth:`Router.submit` calls with
  the same sampling params, at most ``chunk_size``), and at most ``max_chunks_in_flight`` chunks
  are on one rank. A response then does not depend on what else was in flight, so a resumed
  run reproduces the uninterrupted one bit for bit (docs/runs.md).

Routing, the same in both modes: the least-loaded live rank by outstanding work, the estimated
tokens of the requests it holds (prompt + prefix + ``max_new_tokens`` each); ties go to the
lower rank. **Session affinity** (streaming): requests with the same ``session`` key (every turn
of an agentic episode; optionally every sample of an RLVR group) go to the rank that served the
session's first request, where the engine's prefix cache holds it. Affinity yields when that
rank has died or holds more than ``affinity_slack`` times the request's own estimate of
outstanding work beyond the least-loaded rank; the session then moves (it is pinned to the new
rank).

Faults: a rank whose call fails with :class:`~roll_core.errors.WorkerDiedError` is marked dead:
every request it held fails with that error (the rank named), later requests go to the other
ranks, and with no rank left they fail at once. A request that is not answered within
``request_timeout_s`` fails with :class:`GenerationTimeout` naming the rank (and is aborted
there). Nothing waits forever.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.errors import RollError, WorkerDiedError

_ABORT_RESEND_S = 0.5
"""An aborted request still in flight after this long gets its abort sent again."""


class GenerationTimeout(RollError):
    """A generation request was not answered within ``rollout.request_timeout_s``."""


class RouterClosed(RuntimeError):
    """The router was closed while the request waited (the run is shutting down)."""


def estimate_tokens(request: Request, params: SamplingParams) -> int:
    """The work a request puts on its rank: prompt + prefix + ``max_new_tokens`` tokens."""
    return len(request.prompt_ids) + len(request.prefix_ids) + params.max_new_tokens


def aborted(request: Request) -> Completion:
    """The completion of a request aborted before any rank started it: no tokens."""
    return Completion(request.request_id, [], [], "abort", policy_version=-1)


def rollout_mode(rollout: Any) -> str:
    """A recipe's rollout mode in words (the dry-run plan): streaming or fixed chunks."""
    if rollout.deterministic:
        return (
            f"deterministic: fixed chunks of <= {rollout.chunk_size} requests, "
            f"<= {rollout.max_chunks_in_flight} per rank"
        )
    return "streaming: each request on its own, least-loaded rank"


def _unwrap(err: BaseException) -> BaseException:
    """A worker's RollError as itself (Ray wraps it in ``.cause``)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, RollError) else err


@dataclass(eq=False)
class _Ticket:
    """One request the router holds: waiting, or in flight on ``rank``."""

    request: Request
    params: SamplingParams
    out: Future
    cost: int
    session: Hashable | None = None
    rank: int = -1
    deadline: float = 0.0
    aborted: bool = False
    aborted_at: float = 0.0


@dataclass(eq=False)
class _Chunk:
    """Deterministic mode: requests sent together in one fixed-batch call."""

    tickets: list[_Ticket]
    fixed: bool  # made by submit_batch (never merged with other requests)
    rank: int = -1
    deadline: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @property
    def cost(self) -> int:
        return sum(t.cost for t in self.tickets)


class Router:
    """Sends requests to inference ranks (see the module docstring)."""

    def __init__(
        self,
        infer: Any,
        *,
        deterministic: bool = False,
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        request_timeout_s: float = 1800.0,
        affinity_slack: float = 4.0,
    ) -> None:
        self.infer = infer
        self.world_size: int = infer.world_size
        self.deterministic = deterministic
        self.chunk_size = chunk_size
        self.max_chunks_in_flight = max_chunks_in_flight
        self.timeout_s = request_timeout_s
        self.affinity_slack = affinity_slack
        self._cond = threading.Condition()
        self.load = [0] * self.world_size  # estimated outstanding tokens per rank
        self.requests = [0] * self.world_size  # requests in flight per rank
        self.chunks = [0] * self.world_size  # deterministic chunks in flight per rank
        self.dead: dict[int, BaseException] = {}
        self.sessions: dict[Hashable, int] = {}
        self._flight: dict[int, _Ticket] = {}  # request id -> ticket (streaming)
        self._chunks: set[_Chunk] = set()  # deterministic chunks in flight
        self._held: deque[_Ticket | _Chunk] = deque()  # waiting for resume / a chunk slot
        self._paused = False
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self.stats = {"calls": 0.0, "requests": 0.0, "aborted": 0.0, "active_s": 0.0}
        self._active_since = 0.0

    # ---- submitting ---------------------------------------------------------------------------
    def submit(
        self, request: Request, params: SamplingParams, session: Hashable | None = None
    ) -> Future:
        """Generate one response: a Future of its :class:`Completion` (``finish_reason``
        ``"abort"`` with the tokens so far if :meth:`abort` ended it). ``session``: the affinity
        key (streaming mode)."""
        ticket = _Ticket(request, params, _running_future(), estimate_tokens(request, params))
        ticket.session = session
        with self._cond:
            self._check_open(ticket)
            if ticket.out.done():
                return ticket.out
            if self._paused or self.deterministic:
                self._held.append(ticket)
                sends = self._pump()
            else:
                sends = [self._book(ticket)]
        self._start(sends)
        return ticket.out

    def submit_batch(self, requests: list[Request], params: SamplingParams) -> list[Future]:
        """Deterministic mode: these requests as one fixed chunk (membership and order as
        given); one Future per request. In streaming mode: :meth:`submit` each."""
        if not self.deterministic:
            return [self.submit(r, params) for r in requests]
        tickets = [
            _Ticket(r, params, _running_future(), estimate_tokens(r, params)) for r in requests
        ]
        with self._cond:
            for t in tickets:
                self._check_open(t)
            if self._closed:
                return [t.out for t in tickets]
            self._held.append(_Chunk(tickets, fixed=True))
            sends = self._pump()
        self._start(sends)
        return [t.out for t in tickets]

    def release(self, session: Hashable) -> None:
        """Forget a finished session's rank (its next request, if any, is routed afresh)."""
        with self._cond:
            self.sessions.pop(session, None)

    # ---- aborting, pausing ---------------------------------------------------------------------
    def abort(self, request_ids: list[int]) -> None:
        """End these requests now: each future resolves with the partial response (tokens and
        behaviour log-probs so far, ``finish_reason="abort"``). A request not yet sent gets an
        empty one; finished or unknown ids are ignored. Deterministic chunks already in flight
        run to their end (the fixed-batch path cannot be aborted)."""
        ids = set(request_ids)
        with self._cond:
            held = self._take_held(lambda t: t.request.request_id in ids)
            per_rank: dict[int, list[int]] = {}
            for rid in ids:
                ticket = self._flight.get(rid)
                if ticket is not None and not ticket.aborted:
                    ticket.aborted, ticket.aborted_at = True, time.monotonic()
                    per_rank.setdefault(ticket.rank, []).append(rid)
            self.stats["aborted"] += len(held) + sum(len(v) for v in per_rank.values())
        for t in held:
            t.out.set_result(aborted(t.request))
        self._abort_on_ranks(per_rank)

    def abort_all(self) -> None:
        """:meth:`abort` every request the router holds."""
        with self._cond:
            ids = [t.request.request_id for t in self._all_held()] + list(self._flight)
        self.abort(ids)

    def pause(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        """Hold new requests until :meth:`resume` and return once none is in flight (a weight
        sync may then run). ``abort``: end the requests in flight now (their futures resolve
        with partial responses) instead of letting them finish. A request still in flight
        after ``timeout_s`` (default ``request_timeout_s``) raises :class:`GenerationTimeout`
        naming its rank."""
        with self._cond:
            self._paused = True
            ids = list(self._flight)
        if abort:
            self.abort(ids)
        limit = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._flight or self._chunks:
                left = limit - time.monotonic()
                if left <= 0:
                    ranks = sorted(
                        {t.rank for t in self._flight.values()} | {c.rank for c in self._chunks}
                    )
                    raise GenerationTimeout(
                        f"pausing generation for a weight sync: actor_infer rank(s) {ranks} "
                        f"still hold {len(self._flight) + len(self._chunks)} call(s) after "
                        f"{self.timeout_s if timeout_s is None else timeout_s:.0f}s.",
                        hint="The engine on that rank is stuck or far slower than expected: "
                        "see its log; raise rollout.request_timeout_s if responses are just long.",
                    )
                self._cond.wait(min(left, 0.5))

    def resume(self) -> None:
        """Undo :meth:`pause`: held requests go out (in the order they were submitted)."""
        with self._cond:
            self._paused = False
            held, self._held = list(self._held), deque()
            sends: list[Any] = []
            if self.deterministic:
                self._held.extend(held)
                sends = self._pump()
            else:
                for item in held:
                    assert isinstance(item, _Ticket)
                    sends.append(self._book(item))
        self._start(sends)

    def close(self) -> None:
        """Fail every request still held or in flight with :class:`RouterClosed` (and abort the
        ones in flight on their ranks)."""
        with self._cond:
            self._closed = True
            tickets = self._all_held() + list(self._flight.values())
            tickets += [t for c in self._chunks for t in c.tickets]
            per_rank: dict[int, list[int]] = {}
            for t in self._flight.values():
                per_rank.setdefault(t.rank, []).append(t.request.request_id)
            self._held.clear()
            self._flight.clear()
            self._chunks.clear()
            self._cond.notify_all()
        for t in tickets:
            _fail(t.out, RouterClosed("the rollout router was closed"))
        self._abort_on_ranks(per_rank)

    # ---- routing (lock held) --------------------------------------------------------------------
    def pick_rank(self, cost: int, session: Hashable | None = None) -> int:
        """(lock held) The rank for work of ``cost`` tokens (see the module docstring); raises
        the error of the last rank that died when none is left."""
        live = [r for r in range(self.world_size) if r not in self.dead]
        if not live:
            raise next(reversed(self.dead.values()))
        least = min(live, key=lambda r: (self.load[r], r))
        if session is None or self.deterministic:
            return least
        pinned = self.sessions.get(session)
        if pinned in live and self.load[pinned] - self.load[least] <= self.affinity_slack * cost:
            return pinned  # type: ignore[return-value]
        self.sessions[session] = least
        return least

    def _book(self, ticket: _Ticket) -> tuple[str, Any]:
        """(lock held) Route one streaming request and count it on its rank."""
        try:
            ticket.rank = self.pick_rank(ticket.cost, ticket.session)
        except BaseException as err:  # noqa: BLE001 - every rank died: fail it, do not hang
            return ("fail", (ticket, err))
        self._count_in(ticket.rank, ticket.cost, requests=1)
        ticket.deadline = time.monotonic() + self.timeout_s
        self._flight[ticket.request.request_id] = ticket
        return ("one", ticket)

    def _pump(self) -> list[tuple[str, Any]]:
        """(lock held) Deterministic mode: send held chunks while a rank has a chunk slot."""
        if not self.deterministic:
            return []
        sends: list[tuple[str, Any]] = []
        while self._held and not self._paused:
            live = [r for r in range(self.world_size) if r not in self.dead]
            if live and all(self.chunks[r] >= self.max_chunks_in_flight for r in live):
                return sends
            chunk = self._next_chunk()
            try:
                chunk.rank = self.pick_rank(chunk.cost)
            except BaseException as err:  # noqa: BLE001
                sends.extend(("fail", (t, err)) for t in chunk.tickets)
                continue
            self.chunks[chunk.rank] += 1
            self._count_in(chunk.rank, chunk.cost, requests=len(chunk.tickets))
            chunk.deadline = time.monotonic() + self.timeout_s
            self._chunks.add(chunk)
            sends.append(("chunk", chunk))
        return sends

    def _next_chunk(self) -> _Chunk:
        """(lock held) The next chunk: a fixed one as made, else consecutive single requests
        with the same sampling params (at most chunk_size)."""
        first = self._held.popleft()
        if isinstance(first, _Chunk):
            return first
        tickets = [first]
        while (
            len(tickets) < self.chunk_size
            and self._held
            and isinstance(self._held[0], _Ticket)
            and self._held[0].params == first.params
        ):
            tickets.append(self._held.popleft())  # type: ignore[arg-type]
        return _Chunk(tickets, fixed=False)

    def _count_in(self, rank: int, cost: int, *, requests: int) -> None:
        if not self._flight and not self._chunks:
            self._active_since = time.perf_counter()
        self.load[rank] += cost
        self.requests[rank] += requests
        self.stats["calls"] += 1

    def _count_out(self, rank: int, cost: int, *, requests: int) -> None:
        self.load[rank] -= cost
        self.requests[rank] -= requests
        self.stats["requests"] += requests
        if not self._flight and not self._chunks:
            self.stats["active_s"] += time.perf_counter() - self._active_since
        self._cond.notify_all()

    # ---- calls and their answers ---------------------------------------------------------------
    def _start(self, sends: list[tuple[str, Any]]) -> None:
        """Start the calls decided under the lock (outside it: a local call may answer at once
        and its callback takes the lock)."""
        for kind, item in sends:
            if kind == "fail":
                ticket, err = item
                _fail(ticket.out, err)
                continue
            try:
                if kind == "one":
                    call = self.infer.at(item.rank).generate_request(item.request, item.params)
                else:
                    requests = [t.request for t in item.tickets]
                    call = self.infer.at(item.rank).generate(requests, item.tickets[0].params)
            except BaseException as err:  # noqa: BLE001 - a call that cannot even start
                call = Future()
                call.set_exception(err)
            if kind == "one":
                call.add_done_callback(lambda f, t=item: self._one_done(t, f))
                if item.aborted:  # aborted between booking and sending: tell the rank now
                    self._abort_on_ranks({item.rank: [item.request.request_id]})
            else:
                call.add_done_callback(lambda f, c=item: self._chunk_done(c, f))
        if any(kind in ("one", "chunk") for kind, _ in sends):
            self._ensure_watchdog()

    def _one_done(self, ticket: _Ticket, call: Future) -> None:
        err = call.exception()
        with self._cond:
            if self._flight.get(ticket.request.request_id) is not ticket:
                return  # already failed (timeout, dead rank, close)
            del self._flight[ticket.request.request_id]
            self._count_out(ticket.rank, ticket.cost, requests=1)
            others = self._rank_died(ticket.rank, _unwrap(err)) if err is not None else []
        if err is None:
            ticket.out.set_result(call.result())
        else:
            _fail(ticket.out, _unwrap(err))
        self._fail_all(others)

    def _chunk_done(self, chunk: _Chunk, call: Future) -> None:
        err = call.exception()
        with self._cond:
            if chunk not in self._chunks:
                return
            self._chunks.discard(chunk)
            self.chunks[chunk.rank] -= 1
            self._count_out(chunk.rank, chunk.cost, requests=len(chunk.tickets))
            others = self._rank_died(chunk.rank, _unwrap(err)) if err is not None else []
            sends = self._pump()
        if err is None:
            by_id = {c.request_id: c for c in call.result()}
            for t in chunk.tickets:
                t.out.set_result(by_id[t.request.request_id])
        else:
            for t in chunk.tickets:
                _fail(t.out, _unwrap(err))
        self._fail_all(others)
        self._start(sends)

    def _rank_died(self, rank: int, err: BaseException) -> list[tuple[_Ticket, BaseException]]:
        """(lock held) After a failed call: if the rank died, mark it and take every other
        request it held (they fail with the same error)."""
        if not isinstance(err, WorkerDiedError):
            return []
        self.dead[rank] = err
        for session in [s for s, r in self.sessions.items() if r == rank]:
            del self.sessions[session]
        out: list[tuple[_Ticket, BaseException]] = [
            (t, err) for t in self._flight.values() if t.rank == rank
        ]
        for t, _ in out:
            del self._flight[t.request.request_id]
            self._count_out(rank, t.cost, requests=1)
        for chunk in [c for c in self._chunks if c.rank == rank]:
            self._chunks.discard(chunk)
            self.chunks[rank] -= 1
            self._count_out(rank, chunk.cost, requests=len(chunk.tickets))
            out += [(t, err) for t in chunk.tickets]
        return out

    def _fail_all(self, failed: list[tuple[_Ticket, BaseException]]) -> None:
        for ticket, err in failed:
            _fail(ticket.out, err)

    def _abort_on_ranks(self, per_rank: dict[int, list[int]]) -> None:
        for rank, ids in per_rank.items():
            if rank in self.dead or not ids:
                continue
            # best effort: the rank may be going away (its requests then fail by themselves)
            with contextlib.suppress(Exception):
                self.infer.at(rank).abort_requests(ids)

    # ---- timeouts ---------------------------------------------------------------------------------
    def _ensure_watchdog(self) -> None:
        with self._cond:
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(
                    target=self._watch, name="router-watchdog", daemon=True
                )
                self._watchdog.start()

    def _watch(self) -> None:
        """Fail requests past their deadline, naming the rank; exits when nothing is in flight."""
        tick = min(0.5, max(0.01, self.timeout_s / 4))
        while True:
            with self._cond:
                if self._closed or (not self._flight and not self._chunks):
                    self._watchdog = None
                    return
                now = time.monotonic()
                late = [t for t in self._flight.values() if t.deadline <= now]
                # an abort that reached the engine before the request did is lost there:
                # send it again while the request is still in flight
                again: dict[int, list[int]] = {}
                for t in self._flight.values():
                    if t.aborted and now - t.aborted_at > _ABORT_RESEND_S:
                        t.aborted_at = now
                        again.setdefault(t.rank, []).append(t.request.request_id)
                late_chunks = [c for c in self._chunks if c.deadline <= now]
                failed: list[tuple[_Ticket, BaseException]] = []
                per_rank: dict[int, list[int]] = {}
                for t in late:
                    del self._flight[t.request.request_id]
                    self._count_out(t.rank, t.cost, requests=1)
                    failed.append((t, self._timeout(t.rank, 1)))
                    per_rank.setdefault(t.rank, []).append(t.request.request_id)
                for c in late_chunks:
                    self._chunks.discard(c)
                    self.chunks[c.rank] -= 1
                    self._count_out(c.rank, c.cost, requests=len(c.tickets))
                    failed += [(t, self._timeout(c.rank, len(c.tickets))) for t in c.tickets]
                sends = self._pump() if late_chunks else []
            self._fail_all(failed)
            self._abort_on_ranks(per_rank)
            self._abort_on_ranks(again)
            self._start(sends)
            time.sleep(tick)

    def _timeout(self, rank: int, requests: int) -> GenerationTimeout:
        what = "a request" if requests == 1 else f"a chunk of {requests} requests"
        return GenerationTimeout(
            f"actor_infer rank {rank} did not answer {what} within "
            f"rollout.request_timeout_s={self.timeout_s:g}s.",
            hint="The engine on that rank is stuck or far slower than expected: see its log "
            "(`roll logs`); raise rollout.request_timeout_s if responses are just long.",
        )

    # ---- helpers ------------------------------------------------------------------------------------
    def _check_open(self, ticket: _Ticket) -> None:
        if self._closed:
            _fail(ticket.out, RouterClosed("the rollout router was closed"))

    def _take_held(self, match: Any) -> list[_Ticket]:
        """(lock held) Remove the held requests that ``match`` (from fixed chunks too)."""
        taken: list[_Ticket] = []
        kept: deque[_Ticket | _Chunk] = deque()
        for item in self._held:
            if isinstance(item, _Ticket):
                (taken if match(item) else kept).append(item)  # type: ignore[arg-type]
                continue
            gone = [t for t in item.tickets if match(t)]
            taken += gone
            item.tickets = [t for t in item.tickets if not match(t)]
            if item.tickets:
                kept.append(item)
        self._held = kept
        return taken

    def _all_held(self) -> list[_Ticket]:
        out: list[_Ticket] = []
        for item in self._held:
            out += item.tickets if isinstance(item, _Chunk) else [item]
        return out

    def live_ranks(self) -> list[int]:
        """The ranks not known to have died."""
        with self._cond:
            return [r for r in range(self.world_size) if r not in self.dead]

    def active_seconds(self) -> float:
        """Seconds with at least one call in flight so far (the running interval included)."""
        with self._cond:
            busy = bool(self._flight or self._chunks)
            now = time.perf_counter()
            return self.stats["active_s"] + (now - self._active_since if busy else 0.0)

    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        with self._cond:
            return len(self._flight) + sum(len(c.tickets) for c in self._chunks)


def _running_future() -> Future:
    out: Future = Future()
    out.set_running_or_notify_cancel()  # resolved by the router only (abort, not cancel)
    return out


def _fail(out: Future, err: BaseException) -> None:
    if not out.done():
        out.set_exception(err)
