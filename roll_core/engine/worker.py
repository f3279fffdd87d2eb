"""The Worker base class: role logic lives in subclasses (roll_core/workers/), which know
nothing about Ray. An executor creates one instance per rank."""

from __future__ import annotations

from typing import Any


class Worker:
    """One rank of a role. Subclasses take their settings as keyword arguments."""

    def __init__(self, *, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    def ping(self) -> int:
        """Cheap call used to wait until a remote worker is up."""
        return self.rank

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a public method by name (the executors' single entry point)."""
        if method.startswith("_"):
            raise AttributeError(f"{type(self).__name__}.{method} is private")
        return getattr(self, method)(*args, **kwargs)
