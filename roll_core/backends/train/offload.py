"""Offload / reload of a train backend's state, for actor_train colocated with actor_infer.

Three parts can leave the device between training turns, each chosen in the recipe
(`actor_train.offload`, docs/scaling.md "Colocated roles"):

* ``optimizer``: AdamW's moments (`exp_avg`, `exp_avg_sq`; `step` stays where it is) and,
  under DeepSpeed ZeRO, the fp32 master partitions the inner optimizer steps.
* ``params``: the model's parameters and buffers (fsdp2: each rank's DTensor shard; ZeRO-3:
  each parameter's partition `ds_tensor`; ZeRO-1/2: the flat bit16 buffer the parameters
  are views of).
* ``grads``: the gradients the last step left behind. Every step starts by zeroing them
  (`zero_grad(set_to_none=True)`), so they are released, not copied (ZeRO-3 keeps a flat
  gradient partition buffer: it is moved like the others).

A backend whose state lives elsewhere says which tensors each part is with
`offload_tensors(part)` (megatron: its DDP's contiguous parameter and gradient buffers and
its distributed optimizer's shards; gradients are a persistent buffer there, so they are moved,
not released).

The moving is `roll_core.backends.offload.StorageStash` (storage backed up and resized to 0;
pinned CPU memory on a GPU), the same for the three backends. State the backend already keeps
in CPU memory (fsdp2 `cpu_offload`, DeepSpeed `offload_optimizer` / `offload_param`) is left
where it is. DeepSpeed's own
`engine.offload_states()` is not used: it accepts only DeepSpeed's FusedAdam, and roll steps
ZeRO with torch's AdamW.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.backends.offload import StorageStash

TRAIN_PARTS = ("optimizer", "grads", "params")
"""What `actor_train.offload` can move, in the order it is offloaded."""


def _is_deepspeed(backend: Any) -> bool:
    return getattr(backend, "engine", None) is not None


def optimizer_tensors(backend: Any) -> list[torch.Tensor]:
    """The optimizer state of `backend` (without `step`); ZeRO: also the fp32 partitions."""
    optimizer = backend.optimizer
    inner = getattr(optimizer, "optimizer", None) if _is_deepspeed(backend) else None
    torch_optim = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    out = [
        value
        for state in torch_optim.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    ]
    if inner is not None:  # ZeRO: the master partitions the inner optimizer steps
        out += [p for group in torch_optim.param_groups for p in group["params"]]
    return out


def param_tensors(backend: Any) -> list[torch.Tensor]:
    """Parameters and buffers of `backend`'s model (ZeRO-3: the partitions)."""
    model = backend.model
    out: list[torch.Tensor] = []
    for p in model.parameters():
        ds_tensor = getattr(p, "ds_tensor", None)
        if ds_tensor is not None:
            out.append(ds_tensor)
        if p.numel():
            out.append(p)
    return out + list(model.buffers())


def grad_buffers(backend: Any) -> list[torch.Tensor]:
    """Gradient buffers that outlive a step (ZeRO-3's flat partition buffer), moved whole."""
    optimizer = getattr(backend, "optimizer", None)
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    return [flat] if isinstance(flat, torch.Tensor) else []


def release_grads(backend: Any) -> int:
    """Drop the gradients left by the last step; returns their bytes."""
    params = [p for p in backend.model.parameters() if p.grad is not None]
    freed = sum(g.untyped_storage().nbytes() for g in {id(p.grad): p.grad for p in params}.values())
    if _is_deepspeed(backend):
        backend.engine.zero_grad()
    else:
        backend.optimizer.zero_grad(set_to_none=True)
    return freed


class TrainOffloader:
    """One rank's offload state: which parts are off the device, and their backups."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.device = getattr(backend, "device", torch.device("cpu"))
        pin = self.device.type == "cuda"
        self.stashes = {part: StorageStash(pin_memory=pin) for part in TRAIN_PARTS}

    @property
    def offloaded(self) -> list[str]:
        return [part for part, stash in self.stashes.items() if stash.offloaded]

    def offload(self, parts: list[str]) -> dict[str, float]:
        """Move `parts` (a subset of TRAIN_PARTS) off the device; bytes per part."""
        unknown = set(parts) - set(TRAIN_PARTS)
        if unknown:
            raise ValueError(f"unknown offload parts {sorted(unknown)}; valid: {TRAIN_PARTS}")
        out: dict[str, float] = {}
        for part in TRAIN_PARTS:
            if part not in parts or self.stashes[part].offloaded:
                continue
            own = getattr(self.backend, "offload_tensors", None)
            moved = 0
            if own is not None:
                tensors = own(part)
            elif part == "optimizer":
                tensors = optimizer_tensors(self.backend)
            elif part == "params":
                tensors = param_tensors(self.backend)
            else:
                tensors = grad_buffers(self.backend)
                moved = release_grads(self.backend)
            moved += self.stashes[part].offload(tensors, device=self.device)
            out[part] = float(moved)
        return out

    def held_bytes(self, part: str) -> int:
        """Bytes the device still holds for `part` (0 once it is offloaded): what tests and
        the report check the offload against."""
        tensors: list[torch.Tensor]
        own = getattr(self.backend, "offload_tensors", None)
        if own is not None:
            tensors = own(part)
        elif part == "optimizer":
            tensors = optimizer_tensors(self.backend)
        elif part == "params":
            tensors = param_tensors(self.backend)
        else:
            grads = [p.grad for p in self.backend.model.parameters() if p.grad is not None]
            tensors = grads + grad_buffers(self.backend)
        storages = {}
        for t in tensors:
            local = getattr(t, "_local_tensor", t)
            if local.device.type == self.device.type:
                s = local.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def reload(self, parts: tuple[str, ...] = TRAIN_PARTS) -> dict[str, float]:
        """The offloaded `parts` (default: all) back on the device; bytes per part."""
        return {
            part: float(stash.reload())
            for part, stash in self.stashes.items()
            if stash.offloaded and part in parts
        }
