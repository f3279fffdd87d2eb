"""vLLM's async engine (`AsyncLLM`) on an event loop of its own: the request-level mode of
the `vllm` infer backend (``serving: request``, roll_core/backends/infer/vllm_backend.py).

The rank's threads never touch asyncio: :class:`AsyncEngine` runs the engine's loop in one
background thread and every public method submits a coroutine to it
(``asyncio.run_coroutine_threadsafe``) and blocks the calling thread until it is done. Many
threads may wait at once (one per in-flight request); vLLM batches them continuously.

* A request streams its tokens (``RequestOutputKind.DELTA``); the tokens and log-probs so far
  are kept, so an abort returns them (finish reason ``abort``).
* Roll request ids map to unique vLLM ids (``roll-<id>-<n>``): a request aborted and
  re-submitted with its prefix (partial rollout) is a new vLLM request.
* A dead engine (its process killed, a crash in its forward) fails every waiting call with
  :class:`EngineDiedError` naming the engine; the wait polls the engine's health, so nothing
  hangs on a future that will never complete.

Only public `AsyncLLM` methods are used (``generate``, ``abort``, ``pause_generation``,
``resume_generation``, ``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up``,
``shutdown``, ``errored``): the same code serves the CPU and the CUDA builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from roll_core.errors import RollError

T = TypeVar("T")

_POLL_S = 0.5
"""How often a waiting call checks that the engine is still alive."""


class EngineDiedError(RollError):
    """The vLLM engine of an inference rank died (its process killed or crashed): every
    request waiting on it fails with this error."""

    exit_code = 1


@dataclass
class Partial:
    """What one in-flight vLLM request has produced so far."""

    vllm_id: str
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    started: bool = False
    prompt_logprobs: list[float] | None = None
    """Each prompt token's log-prob (NaN for the first), when the request asked for them."""


class AsyncEngine:
    """An `AsyncLLM` built from `engine_args` (an ``AsyncEngineArgs``) on a background event
    loop; every method is called from ordinary threads and blocks until done."""

    def __init__(self, engine_args: Any, *, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inflight: dict[int, list[Partial]] = {}  # roll request id -> its vLLM requests
        self._closed = False
        self.engine: Any = None
        try:
            self.engine = self._submit(self._start(engine_args)).result()
        except BaseException:
            self._stop_loop()
            raise
        self.model_config = self.engine.model_config

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self, engine_args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        # built on the loop's thread: the engine's output handler is a task of this loop
        return AsyncLLM.from_engine_args(engine_args)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _dead(self) -> str | None:
        """Why the engine cannot answer any more (None while it is healthy)."""
        if not self._thread.is_alive():
            return "its event-loop thread stopped"
        engine = self.engine
        if engine is not None and engine.errored:
            return "its engine-core process exited"
        return None

    def _died(self, detail: str) -> EngineDiedError:
        pids = self.engine_pids()
        where = f" (engine-core pid {', '.join(map(str, pids))})" if pids else ""
        return EngineDiedError(
            f"{self.name}{where} died: {detail}. Every request waiting on it fails.",
            hint="The engine's own log above says why (out of memory, a crash in the model's "
            "forward, a killed process). Restart the run (`roll resume RUN_ID` continues from "
            "the last checkpoint).",
        )

    def wait(self, future: Future[T]) -> T:
        """The result of `future`, failing with EngineDiedError instead of hanging when the
        engine dies before it completes."""
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except TimeoutError:
                reason = self._dead()
                if reason is not None and not future.done():
                    future.cancel()
                    raise self._died(reason) from None
            except CancelledError:
                if self._closed:
                    raise RuntimeError(f"{self.name} was closed while this call waited") from None
                raise
            except Exception as err:
                if _is_engine_dead(err):
                    raise self._died(f"{type(err).__name__}: {err}") from err
                raise

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run the engine's coroutine method `fn(*args, **kwargs)` on its loop; its result."""

        async def run() -> T:
            return await fn(*args, **kwargs)

        return self.wait(self._submit(run()))

    # ---- requests -----------------------------------------------------------------------------
    def submit(
        self, request_id: int, prompt: Any, sampling: Any, lora: Any = None
    ) -> Future[Partial]:
        """Start one request (with the LoRA adapter `lora`, a ``LoRARequest``, or none); the
        future gives its :class:`Partial` once it finished or was aborted (finish_reason
        ``stop``, ``length`` or ``abort``)."""
        from vllm.sampling_params import RequestOutputKind

        sampling.output_kind = RequestOutputKind.DELTA  # stream: keep what is generated
        part = Partial(vllm_id=f"roll-{request_id}-{next(self._ids)}")
        with self._lock:
            self._inflight.setdefault(request_id, []).append(part)
        try:
            return self._submit(self._generate(request_id, part, prompt, sampling, lora))
        except BaseException:
            self._forget(request_id, part)
            raise

    def _forget(self, request_id: int, part: Partial) -> None:
        with self._lock:
            parts = self._inflight.get(request_id, [])
            if part in parts:
                parts.remove(part)
            if not parts:
                self._inflight.pop(request_id, None)

    async def _generate(
        self, request_id: int, part: Partial, prompt: Any, sampling: Any, lora: Any
    ) -> Partial:
        try:
            with self._lock:  # against abort(): either it sees the request started or we see it
                if part.aborted:  # aborted before it reached the engine
                    part.finish_reason = "abort"
                    return part
                part.started = True
            abort_sent = False
            async for out in self.engine.generate(
                prompt, sampling, part.vllm_id, lora_request=lora
            ):
                if out.prompt_logprobs is not None and part.prompt_logprobs is None:
                    ids = prompt["prompt_token_ids"]
                    part.prompt_logprobs = [
                        float("nan") if entry is None else float(entry[tok].logprob)
                        for tok, entry in zip(ids, out.prompt_logprobs, strict=True)
                    ]
                done = out.outputs[0]
                tokens = list(done.token_ids)
                part.token_ids.extend(tokens)
                if tokens:
                    logps = done.logprobs
                    part.log_probs.extend(
                        float(entry[tok].logprob) for tok, entry in zip(tokens, logps, strict=True)
                    )
                    if sampling.logprobs:
                        part.top_logprobs.extend(
                            top_entries(entry, sampling.logprobs) for entry in logps
                        )
                if done.finish_reason is not None:
                    part.finish_reason = str(done.finish_reason)
                if part.aborted and part.finish_reason is None and not abort_sent:
                    # the abort came before the engine knew the id: send it again
                    abort_sent = True
                    await self.engine.abort(part.vllm_id)
            if part.finish_reason is None:
                part.finish_reason = "abort"
            return part
        finally:
            self._forget(request_id, part)

    def abort(self, request_ids: list[int]) -> None:
        """Finish these requests now (their futures give the partial response); ids not in
        flight are ignored."""
        with self._lock:
            parts = [p for rid in request_ids for p in self._inflight.get(rid, [])]
            for p in parts:
                p.aborted = True
            started = [p.vllm_id for p in parts if p.started]
        if started and self._dead() is None:
            self.call(self.engine.abort, started)

    # ---- engine control -----------------------------------------------------------------------
    def pause(self) -> None:
        """No engine step until :meth:`resume`; in-flight requests keep their place and KV
        cache (``mode="keep"``), new ones queue. Returns once no step is running."""
        self.call(self.engine.pause_generation, mode="keep", clear_cache=False)

    def resume(self) -> None:
        self.call(self.engine.resume_generation)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """`method` on every vLLM worker (the roll_* methods of vllm_worker.py)."""
        return list(self.call(self.engine.collective_rpc, method, args=args, kwargs=kwargs))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block, including those of running requests: they are
        recomputed under the weights now loaded (they came from the old ones)."""
        return bool(self.call(self.engine.reset_prefix_cache, reset_running_requests=True))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (CUDA build); in-flight requests are kept (``mode="keep"``)."""
        self.call(self.engine.sleep, level=level, mode="keep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.call(self.engine.wake_up, tags=tags)

    def engine_pids(self) -> list[int]:
        """The engine-core process ids (for error messages and tests); empty when unknown."""
        manager = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        procs = getattr(getattr(manager, "engine_manager", None), "processes", None) or []
        return [int(p.pid) for p in procs if getattr(p, "pid", None)]

    def close(self) -> None:
        """Shut the engine down and stop the loop thread."""
        if self._closed:
            return
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):  # a dead engine may fail its own shutdown
                engine.shutdown()
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        if self._loop.is_running():
            # the engine's output tasks and any request still waiting end cancelled, not
            # destroyed pending
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _is_engine_dead(err: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - the module exists in every vLLM 0.1x+
        return False
    return isinstance(err, EngineDeadError)


def top_entries(entry: Any, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (id, log-prob) of one position's vLLM log-prob dict (which holds
    the sampled token and the top ``k``, each with its 1-based ``rank``)."""
    ranked = sorted(
        (e.rank, tok, float(e.logprob))
        for tok, e in entry.items()
        if e.rank is not None and e.rank <= k
    )
    return [(tok, lp) for _, tok, lp in ranked]
