"""Infer backends behind one interface, chosen by `actor_infer.backend`."""

from roll_core.backends.infer.base import Completion, InferBackend, Request, SamplingParams

INFER_BACKENDS = ("hf",)
"""Backend names; the classes are imported lazily (vLLM is an optional extra)."""


def make_infer_backend(name: str, **kwargs: object) -> InferBackend:
    """Build the backend `name` (imports it only when asked for)."""
    if name == "hf":
        from roll_core.backends.infer.hf import HFInferBackend

        return HFInferBackend(**kwargs)  # type: ignore[arg-type]
    from roll_core.errors import ConfigError

    raise ConfigError(
        f"actor_infer.backend: unknown backend {name!r}; valid: {', '.join(INFER_BACKENDS)}."
    )


__all__ = [
    "INFER_BACKENDS",
    "Completion",
    "InferBackend",
    "Request",
    "SamplingParams",
    "make_infer_backend",
]
