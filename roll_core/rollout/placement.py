"""How an RLVR recipe's rollout runs, decided before anything starts: where generation and
training are placed (the dry-run's line) and whether partial rollout is possible."""

from __future__ import annotations

from roll_core.errors import ConfigError


def check_prefix_support(
    backend: str, supported: bool, *, partial_rollout: bool, allow_fallback: bool
) -> bool:
    """Whether partial rollout is used: True when asked for and the backend can continue from a
    prefix; False (abort and re-queue) when the recipe allows the fallback; else ConfigError."""
    if not partial_rollout or supported:
        return partial_rollout
    if allow_fallback:
        return False
    raise ConfigError(
        f"rollout.partial_rollout is on, but actor_infer.backend={backend!r} cannot continue a "
        "response from its generated prefix.",
        hint="Turn rollout.partial_rollout off (requests in flight at a weight sync are then "
        "aborted and re-queued), set rollout.partial_rollout_fallback=true to allow that "
        "fallback, or use a backend that continues from a prefix (hf).",
    )


def _resolve(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rollout_placement(
    *,
    ratio: int,
    executor: str,
    train_device: str,
    infer_device: str,
    train_gpus: list[int] | None = None,
    infer_gpus: list[int] | None = None,
) -> str:
    """How rollout and training are placed, in words (the dry-run prints it); ConfigError for
    an async recipe that puts both on one accelerator, where they cannot overlap.

    Async mode is disaggregated: generation runs in its own worker (its own thread in the
    local executor, its own Ray actor in the ray executor) on its own device. On CPU the two
    share the host's cores: they run concurrently but compete for the same cores.
    """
    train, infer = _resolve(train_device), _resolve(infer_device)
    if ratio == 0:
        where = "colocated" if train == infer else "separate devices"
        return f"sync: {where}, generate then train (no overlap)"
    overlap_gpus = sorted(set(train_gpus or []) & set(infer_gpus or []))
    one_gpu = train == infer == "cuda" and (executor == "local" or overlap_gpus)
    if one_gpu:
        on = f"GPU(s) {overlap_gpus}" if overlap_gpus else "the one CUDA device of this process"
        raise ConfigError(
            f"rollout.async_generation_ratio={ratio} asks generation to run while training "
            f"trains, but the recipe colocates actor_infer and actor_train on {on}: both would "
            "time-share one device (and its memory), so they cannot overlap and async would "
            "only add staleness.",
            hint="Give actor_infer and actor_train different devices (executor.type=ray with "
            "non-overlapping device_mapping, or actor_infer.device=cpu for a test), or set "
            "rollout.async_generation_ratio=0 to train synchronously.",
        )
    if train == infer == "cpu":
        return (
            f"async (ratio {ratio}): disaggregated workers on the CPU; generation and "
            "training overlap in time but share the host's cores"
        )
    return f"async (ratio {ratio}): disaggregated, rollout on {infer}, training on {train}"
