"""ActorInfer: the role that generates rollouts with the current policy. No Ray here."""

from __future__ import annotations

import time
from typing import Any

from roll_core.backends.infer import (
    Completion,
    InferBackend,
    Request,
    SamplingParams,
    make_infer_backend,
)
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch


class ActorInfer(Worker):
    """One inference rank: generate, receive weights, report its RNG for checkpoints."""

    def __init__(self, *, backend: str, backend_kwargs: dict[str, Any], **rank_info: Any) -> None:
        super().__init__(**rank_info)
        self.backend_name = backend
        self.backend_kwargs = backend_kwargs
        self.backend: InferBackend | None = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        self.backend = make_infer_backend(self.backend_name, **self.backend_kwargs)
        return {"backend": self.backend_name}

    def _b(self) -> InferBackend:
        if self.backend is None:
            raise RuntimeError("ActorInfer.setup() was not called")
        return self.backend

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        return self._b().generate(requests, params)

    @dispatch("all")
    def update_weights(self, named_tensors: dict[str, Any], *, version: int) -> None:
        self._b().update_weights(named_tensors, version=version)

    @dispatch("all")
    def get_rng_state(self) -> Any:
        return self._b().get_rng_state()

    @dispatch("scatter")
    def set_rng_state(self, state: Any) -> None:
        self._b().set_rng_state(state)

    # ---- taking turns with a colocated actor_train (docs/scaling.md "Colocated roles") -------
    def _report(self, moved: int, start: float) -> dict[str, float]:
        from roll_core.backends.offload import device_memory

        backend = self._b()
        out = {"bytes/moved": float(moved), "seconds": time.perf_counter() - start}
        memory = getattr(backend, "memory", None)
        mem = memory() if memory is not None else device_memory(getattr(backend, "device", None))
        return out | {f"memory/{k}": v for k, v in mem.items()}

    @dispatch("all")
    def offload(self, parts: list[str], *, level: int = 1) -> dict[str, float]:
        """Free `parts` (`weights`, `kv_cache`) of this rank's engine (vLLM: sleep at
        `level`); returns seconds, bytes and the device memory after."""
        start = time.perf_counter()
        return self._report(self._b().release(list(parts), level=level), start)

    @dispatch("all")
    def reload(self, parts: list[str]) -> dict[str, float]:
        """Bring `parts` back (vLLM: wake_up(tags=parts)); the same report."""
        start = time.perf_counter()
        return self._report(self._b().restore(list(parts)), start)

    @dispatch("all")
    def memory(self) -> dict[str, float]:
        """This rank's device memory now (GiB)."""
        report = self._report(0, time.perf_counter())
        return {k.removeprefix("memory/"): v for k, v in report.items() if k.startswith("memory/")}
