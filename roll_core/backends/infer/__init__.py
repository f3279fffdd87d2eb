"""Infer backends behind one interface, chosen by `actor_infer.backend`."""

from typing import Any

from roll_core.backends.infer.base import Completion, InferBackend, Request, SamplingParams

INFER_BACKENDS = ("hf", "vllm")
"""Backend names; the classes are imported lazily (vLLM is an optional extra)."""


def make_infer_backend(name: str, **kwargs: object) -> InferBackend:
    """Build the backend `name` (imports it only when asked for)."""
    if name == "hf":
        from roll_core.backends.infer.hf import HFInferBackend

        return HFInferBackend(**kwargs)  # type: ignore[arg-type]
    if name == "vllm":
        from roll_core.backends.infer.vllm_backend import VLLMInferBackend

        return VLLMInferBackend(**kwargs)  # type: ignore[arg-type]
    from roll_core.errors import ConfigError

    raise ConfigError(
        f"actor_infer.backend: unknown backend {name!r}; valid: {', '.join(INFER_BACKENDS)}."
    )


def infer_backend_options(
    role: Any,
    *,
    model_dtype: str,
    seed: int = 0,
    train_precision: str = "auto",
    sync_bucket_mb: float = 256,
    sleep_mode: bool = False,
    serving: str | None = None,
) -> dict[str, Any]:
    """The backend-specific keyword arguments of an ActorInferConfig (the `vllm` block for
    the vllm backend, with `sync.bucket_mb` for its `driver` sync path; for hf the model
    dtype and the precision, `auto` meaning the trainer's), for `backend_kwargs`.
    `sleep_mode`: the engine frees its memory between turns (vLLM's sleep mode, colocated
    offload). `serving`: ``request`` (requests answered one by one as they finish, vLLM's
    async engine) or ``batch`` (``vllm.LLM``, whole lists); None keeps the backend's default
    (``request``)."""
    if role.backend != "vllm":
        import torch

        precision = role.precision if role.precision != "auto" else train_precision
        return {"dtype": getattr(torch, model_dtype), "precision": precision}
    from roll_core.config.rlvr import VLLMConfig

    opts = role.vllm if role.vllm is not None else VLLMConfig()
    return {
        "dtype": model_dtype if opts.dtype == "auto" else opts.dtype,
        "seed": seed,
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "cpu_kv_cache_gb": opts.cpu_kv_cache_gb,
        "enforce_eager": opts.enforce_eager,
        "tensor_parallel_size": opts.tensor_parallel_size,
        "max_model_len": opts.max_model_len,
        "sync_bucket_mb": sync_bucket_mb,
        **({"sleep_mode": True} if sleep_mode else {}),
        **({"serving": serving} if serving is not None else {}),
    }


__all__ = [
    "INFER_BACKENDS",
    "Completion",
    "InferBackend",
    "Request",
    "SamplingParams",
    "infer_backend_options",
    "make_infer_backend",
]
