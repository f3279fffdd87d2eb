"""Executors: `local` (every worker in this process) and `ray` (one Ray actor per rank)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from roll_core.engine.worker import Worker
from roll_core.errors import ConfigError, RollError


class _LocalHandle:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.worker.call(method, *args, **kwargs)

    def submit_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run the call on this rank's own thread (calls to one rank stay in order)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roll-worker")
        return self._pool.submit(self.worker.call, method, *args, **kwargs)


class LocalExecutor:
    """Runs workers in the driver process: the debug mode and the single-device mode."""

    name = "local"

    def spawn(
        self,
        worker_cls: type[Worker],
        *,
        rank: int,
        world_size: int,
        resources: Mapping[str, float],
        kwargs: dict[str, Any],
    ) -> _LocalHandle:
        return _LocalHandle(worker_cls(rank=rank, world_size=world_size, **kwargs))

    def gather(self, futures: list[Any]) -> list[Any]:
        return futures

    def shutdown(self) -> None:
        pass


class _RayHandle:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.actor.call.remote(method, *args, **kwargs)

    def submit_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return self.actor.call.remote(method, *args, **kwargs).future()


class RayExecutor:
    """One Ray actor per rank; starts a local Ray cluster unless `address` names one."""

    name = "ray"

    def __init__(self, *, address: str | None = None, num_cpus: int | None = None) -> None:
        import ray

        self._ray = ray
        self._started_here = False
        if not ray.is_initialized():
            os.environ.setdefault("RAY_DEDUP_LOGS", "0")
            try:
                ray.init(
                    address=address,
                    num_cpus=None if address else num_cpus,
                    include_dashboard=False,
                    log_to_driver=True,
                    configure_logging=False,
                )
            except ConnectionError as err:
                raise ConfigError(
                    f"executor.ray_address={address!r}: cannot connect to Ray ({err}).",
                    hint="Start the cluster with `ray start --head` or leave ray_address empty "
                    "to start a local one.",
                ) from None
            self._started_here = True

    def spawn(
        self,
        worker_cls: type[Worker],
        *,
        rank: int,
        world_size: int,
        resources: Mapping[str, float],
        kwargs: dict[str, Any],
    ) -> _RayHandle:
        options = {
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            "name": None,
        }
        actor_cls = self._ray.remote(worker_cls)
        actor = actor_cls.options(**options).remote(rank=rank, world_size=world_size, **kwargs)
        return _RayHandle(actor)

    def gather(self, futures: list[Any]) -> list[Any]:
        from ray.exceptions import RayTaskError

        try:
            return self._ray.get(futures)
        except RayTaskError as err:
            # A user-fixable error inside a worker surfaces as itself, not as a Ray traceback.
            if isinstance(err.cause, RollError):
                raise err.cause from None
            raise

    def shutdown(self) -> None:
        if self._started_here and self._ray.is_initialized():
            self._ray.shutdown()


def make_executor(kind: str, *, address: str | None = None, num_cpus: int | None = None) -> Any:
    """The executor named by `executor.type`."""
    if kind == "local":
        return LocalExecutor()
    if kind == "ray":
        return RayExecutor(address=address, num_cpus=num_cpus)
    raise ConfigError(f"executor.type: unknown executor {kind!r}; valid: local, ray.")
