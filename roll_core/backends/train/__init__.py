"""Train backends behind one interface, chosen by `actor_train.backend`.

`torch` is imported eagerly; `fsdp2`, `deepspeed` and `megatron` are imported when chosen, so a missing
optional dependency only matters to the recipes that use it."""

from __future__ import annotations

import importlib
from typing import Any

from roll_core.backends.train.base import TrainBackend
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.errors import ConfigError

TRAIN_BACKENDS: dict[str, str] = {
    "torch": "roll_core.backends.train.torch_backend:TorchTrainBackend",
    "fsdp2": "roll_core.backends.train.fsdp2:FSDP2TrainBackend",
    "deepspeed": "roll_core.backends.train.deepspeed_backend:DeepSpeedTrainBackend",
    "megatron": "roll_core.backends.train.megatron_backend:MegatronTrainBackend",
}
"""Backend name -> "module:class". The schema's Literal keeps the names in step with this."""

MULTI_RANK_BACKENDS = ("fsdp2", "deepspeed", "megatron")
"""Backends whose ranks form a torch.distributed group (one process per rank)."""


def get_train_backend(name: str) -> Any:
    """The backend class registered as `name`; the error lists the valid names."""
    if name not in TRAIN_BACKENDS:
        raise ConfigError(
            f"actor_train.backend: unknown train backend {name!r}; valid: "
            f"{', '.join(TRAIN_BACKENDS)}."
        )
    module, cls = TRAIN_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = [
    "MULTI_RANK_BACKENDS",
    "TRAIN_BACKENDS",
    "TorchTrainBackend",
    "TrainBackend",
    "get_train_backend",
]
