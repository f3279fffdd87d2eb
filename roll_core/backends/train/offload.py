"""Offload / reload of a train backend's GPU state, for roles colocated on the same GPUs.

Between phases (generation, then training) a colocated trainer moves its weights, gradients
and optimizer state to CPU memory and back, so the inference engine can use the GPU. On a
CPU-only machine both calls are no-ops. GPU path: written, not yet run on a GPU in our tests.
"""

from __future__ import annotations

from typing import Any

import torch


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def offload(backend: Any) -> dict[str, float]:
    """Weights, grads and optimizer state of `backend` to CPU memory; returns bytes freed."""
    device = getattr(backend, "device", torch.device("cpu"))
    if device.type == "cpu":
        return {"offload/bytes": 0.0}
    before = torch.cuda.memory_allocated(device)
    engine = getattr(backend, "engine", None)
    if engine is not None:  # DeepSpeed: ZeRO-3 can offload its partitions itself
        if hasattr(engine, "offload_states"):
            engine.offload_states()
    else:
        backend.model.to("cpu")
        _move_optimizer_state(backend.optimizer, torch.device("cpu"))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return {"offload/bytes": float(before - torch.cuda.memory_allocated(device))}


def reload(backend: Any) -> None:
    """Undo `offload`: everything back on the backend's device."""
    device = getattr(backend, "device", torch.device("cpu"))
    if device.type == "cpu":
        return
    engine = getattr(backend, "engine", None)
    if engine is not None:
        if hasattr(engine, "reload_states"):
            engine.reload_states()
    else:
        backend.model.to(device)
        _move_optimizer_state(backend.optimizer, device)
    torch.cuda.synchronize(device)
