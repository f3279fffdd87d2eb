"""A Cluster is N ranks of one Worker class, run by an executor.

`cluster.run(method, ...)` calls every rank with the same arguments; `cluster.run_dp(method,
batch)` splits a Batch across ranks (data parallel), calls, and returns the per-rank results.
The calls read the same with the `local` executor (instances in this process, no Ray) and the
`ray` executor (one Ray actor per rank)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from roll_core.data import Batch
from roll_core.engine.worker import Worker


class Handle(Protocol):
    """What an executor returns for one rank."""

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def submit_async(self, method: str, *args: Any, **kwargs: Any) -> Future: ...


class Executor(Protocol):
    name: str

    def spawn(
        self,
        worker_cls: type[Worker],
        *,
        rank: int,
        world_size: int,
        resources: Mapping[str, float],
        kwargs: dict[str, Any],
    ) -> Handle: ...

    def gather(self, futures: list[Any]) -> list[Any]: ...

    def shutdown(self) -> None: ...


class Cluster:
    """`world_size` ranks of `worker_cls`, each built with `worker_kwargs`."""

    def __init__(
        self,
        name: str,
        worker_cls: type[Worker],
        executor: Executor,
        *,
        world_size: int = 1,
        resources: Mapping[str, float] | None = None,
        worker_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.executor = executor
        self.world_size = world_size
        self.handles = [
            executor.spawn(
                worker_cls,
                rank=rank,
                world_size=world_size,
                resources=resources or {},
                kwargs=worker_kwargs or {},
            )
            for rank in range(world_size)
        ]
        self.run("ping")

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        return self.executor.gather([h.submit(method, *args, **kwargs) for h in self.handles])

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.executor.gather([self.handles[0].submit(method, *args, **kwargs)])[0]

    def submit(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Future:
        """Start `method` on one rank without waiting: a concurrent.futures.Future.

        Used by the rollout scheduler to keep every rank busy while results stream back.
        Errors surface from `future.result()` (a worker's RollError as itself).
        """
        return self.handles[rank].submit_async(method, *args, **kwargs)

    def run_dp(self, method: str, batch: Batch, **kwargs: Any) -> list[Any]:
        """Split `batch` into one contiguous shard per rank and call `method` on each."""
        shards = batch.split(self.world_size)
        futures = [
            h.submit(method, shard, **kwargs) for h, shard in zip(self.handles, shards, strict=True)
        ]
        return self.executor.gather(futures)
