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
        self._sync_group: Any = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        self.backend = make_infer_backend(self.backend_name, **self.backend_kwargs)
        return {"backend": self.backend_name}

    def _b(self) -> InferBackend:
        if self.backend is None:
            raise RuntimeError("ActorInfer.setup() was not called")
        return self.backend

    @dispatch("one")
    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        """A whole list at once, answered when all are done (the deterministic, fixed-batch
        path: ``rollout.deterministic``; evaluation)."""
        return self._b().generate(requests, params)

    # ---- request-level serving (backends/infer/base.py RequestEngine) -------------------------
    @dispatch("one", concurrent=True)
    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        """One request, answered the moment it finishes (the engine batches continuously
        across the concurrent calls)."""
        return self._b().generate_request(request, params)  # type: ignore[attr-defined]

    @dispatch("all", concurrent=True)
    def abort_requests(self, request_ids: list[int]) -> None:
        """Finish these requests now (their calls return partial responses); unknown or
        finished ids are ignored."""
        self._b().abort(list(request_ids))  # type: ignore[attr-defined]

    @dispatch("all", concurrent=True)
    def pause_generation(self) -> None:
        """No decoding step until `resume_generation` (around a weight sync)."""
        self._b().pause()  # type: ignore[attr-defined]

    @dispatch("all", concurrent=True)
    def resume_generation(self) -> None:
        self._b().resume()  # type: ignore[attr-defined]

    @dispatch("all")
    def update_weights(self, named_tensors: dict[str, Any], *, version: int) -> None:
        """`sync.path: driver`: weights sent by the driver, loaded in place."""
        self._b().update_weights(named_tensors, version=version)

    # ---- weight sync (roll_core/engine/weight_sync.py) ----------------------------------------
    @dispatch("all")
    def sync_endpoints(self) -> list[dict[str, Any]]:
        """Where this rank's receivers live: itself, or each of vLLM's worker processes (they
        join the group themselves)."""
        backend = self._b()
        if hasattr(backend, "sync_endpoints"):
            return backend.sync_endpoints()  # type: ignore[no-any-return]
        from roll_core.backends.sync_transport import endpoint

        return [endpoint(getattr(backend, "device", "cpu"))]

    @dispatch("all")
    def sync_join(self, *, group_rank: int, **group: Any) -> None:
        """Join the weight-sync group as `group_rank` (this rank's receivers take
        group_rank, group_rank + 1, ...)."""
        backend = self._b()
        if hasattr(backend, "sync_join"):
            backend.sync_join(group_rank=group_rank, **group)
            return
        from roll_core.backends.sync_transport import SyncGroup

        if self._sync_group is not None:
            self._sync_group.close()
        self._sync_group = SyncGroup(rank=group_rank, **group)

    @dispatch("all")
    def sync_receive(self, *, version: int) -> dict[str, int]:
        """Receive every bucket from actor_train rank 0, load it in place, stamp `version`.
        Returns {"tensors": loaded, ...} for the driver's check."""
        backend = self._b()
        if hasattr(backend, "sync_receive"):
            return backend.sync_receive(version=version)  # type: ignore[no-any-return]
        if self._sync_group is None:
            raise RuntimeError("ActorInfer.sync_receive before sync_join")
        loaded = 0

        def load(items: list[tuple[str, Any]]) -> None:
            nonlocal loaded
            self._load_bucket(items)
            loaded += len(items)

        stats = self._sync_group.receive(load)
        self.finish_sync(version)
        return {**stats, "tensors": loaded}

    def _load_bucket(self, items: list[tuple[str, Any]]) -> None:
        self._b().load_weights_bucket(items)  # type: ignore[attr-defined]

    def load_sync_bucket(self, items: list[tuple[str, Any]], *, share: bool = False) -> None:
        """`same_process` path: copy these tensors into the model in place; `share`: take
        their storage instead where the backend can (the hf engine: one model in memory)."""
        backend: Any = self._b()
        if share and hasattr(backend, "share_weights_bucket"):
            backend.share_weights_bucket(items)
        else:
            self._load_bucket(items)

    def finish_sync(self, version: int) -> None:
        """Stamp the policy version of the weights now loaded."""
        self._b().finish_sync(version)  # type: ignore[attr-defined]

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
