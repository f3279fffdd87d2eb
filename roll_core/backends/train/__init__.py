"""Train backends behind one interface, chosen by `actor_train.backend`.

`torch` is imported eagerly; `fsdp2`, `deepspeed` and `megatron` are imported when chosen, so a missing
optional dependency only matters to the recipes that use it: `check_backend_installed` refuses
such a recipe before anything starts (validation, `--dry-run`, a new run, a resume), naming the
extra of roll that installs it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
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


BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "deepspeed": ("deepspeed", "deepspeed"),
    "megatron": ("megatron.core", "megatron-core"),
}
"""Backend name -> (the module it imports, its PyPI project) for the backends that need a
package beyond torch; roll's extra of the backend's name installs it (pyproject.toml)."""


def check_backend_installed(name: str) -> None:
    """A ConfigError naming `pip install 'roll[NAME]'` when train backend `name` needs a
    package this Python environment lacks (nothing is imported: the check is instant)."""
    if name not in BACKEND_PACKAGES:
        return
    module, project = BACKEND_PACKAGES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or not importable
        found = False
    if not found:
        raise ConfigError(
            f"actor_train.backend is {name}, which needs {project}, and {project} is not "
            f"installed in this Python environment ({sys.executable}).",
            hint=f"Install it with `pip install 'roll[{name}]'` (from a checkout: `pip install "
            f"-e '.[{name}]'`; CPU machines: add `-c constraints-cpu.txt`), or pick another "
            "actor_train.backend (fsdp2 needs nothing beyond torch).",
        )


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
    "BACKEND_PACKAGES",
    "MULTI_RANK_BACKENDS",
    "TRAIN_BACKENDS",
    "TorchTrainBackend",
    "TrainBackend",
    "check_backend_installed",
    "get_train_backend",
]
