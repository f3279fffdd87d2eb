"""ActorInfer: the role that generates rollouts with the current policy. No Ray here."""

from __future__ import annotations

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
