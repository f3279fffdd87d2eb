"""A Cluster is N ranks of one Worker class, run by an executor.

`cluster.method(...)` calls a worker method the way the method declares with
`@dispatch(...)` (roll_core/engine/worker.py): on every rank with the same arguments, split
data-parallel over the ranks, on rank 0, or scattered one item per rank; and returns what the
declaration's `collect=` says (the per-rank list, one concatenated value, reduced metrics,
rank 0's result), so no caller joins per-rank results itself. `cluster.at(rank).method(...)`
is the non-blocking form on one rank (a Future). The explicit forms
underneath are `cluster.run(method, ...)` (every rank), `cluster.run_dp(method, batch)` (a
Batch split across ranks, the per-rank results returned) and `cluster.run_rank0`.
The calls read the same with the `local` executor (instances in this process, no Ray) and the
`ray` executor (one Ray actor per rank).

When the worker class says its ranks form a torch.distributed group
(`Worker.needs_process_group`, e.g. actor_train with `world_size > 1` or the fsdp2 / deepspeed
backends), every rank runs in its own process (a subprocess under `local`), the cluster sets
up the group (gloo on CPU, nccl on GPU) before anything else, batches are split by token
count, and `run_rank0` calls every rank (gathering a sharded model is a collective) and
returns rank 0's answer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from roll_core.data import Batch
from roll_core.engine.dispatch import collect_results, split_by_tokens
from roll_core.engine.process import chain_future
from roll_core.engine.worker import Worker, collect_mode, dispatch_mode
from roll_core.errors import WorkerDiedError


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
        resources: Mapping[str, Any],
        kwargs: dict[str, Any],
        isolated: bool = False,
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
        gpu_ids: list[tuple[int, ...]] | None = None,
        gpus_per_node: int = 8,
    ) -> None:
        """`gpu_ids[r]`: the global GPU ids of rank r (from roll_core/engine/placement.py);
        the executor pins the rank to them (CUDA_VISIBLE_DEVICES; on Ray, the node's bundle
        of one placement group over the cluster). None: no pinning."""
        self.name = name
        self.worker_cls = worker_cls
        self.executor = executor
        self.world_size = world_size
        self.distributed = worker_cls.needs_process_group(world_size, worker_kwargs or {})
        self.handles = [
            executor.spawn(
                worker_cls,
                rank=rank,
                world_size=world_size,
                resources=_rank_resources(resources, gpu_ids, rank, gpus_per_node),
                kwargs=worker_kwargs or {},
                **({"isolated": True} if self.distributed else {}),
            )
            for rank in range(world_size)
        ]
        self.run("ping")
        self.dist_backend: str | None = None
        if self.distributed:
            address, port = self.run_one(0, "dist_endpoint")
            self.dist_backend = self.run("init_process_group", address, port)[0]

    def _gather(self, futures: list[Any]) -> list[Any]:
        try:
            return self.executor.gather(futures)
        except WorkerDiedError as err:
            raise self._named(err) from None

    def _named(self, err: BaseException) -> BaseException:
        """A worker death as this cluster's: `worker actor_train rank 1 died (...)`."""
        if isinstance(err, WorkerDiedError) and not err.role:
            return WorkerDiedError(self.name, err.rank, err.detail)
        return err

    def __getattr__(self, method: str) -> Callable[..., Any]:
        """`cluster.train_step(batch)`: the worker method, dispatched as it declares."""
        worker_cls = self.__dict__.get("worker_cls")
        if method.startswith("_") or worker_cls is None:
            raise AttributeError(method)
        mode = dispatch_mode(worker_cls, method)
        if mode is None:
            raise AttributeError(
                f"{worker_cls.__name__}.{method} is not a cluster method (no @dispatch)"
            )
        if mode == "one":
            raise AttributeError(
                f"{worker_cls.__name__}.{method} runs on the rank the caller picks: call "
                f"cluster.at(rank).{method}(...)"
            )
        calls: dict[str, Callable[..., Any]] = {
            "all": self.run,
            "dp": self.run_dp,
            "rank0": self.run_rank0,
            "scatter": self.run_scatter,
        }
        call = functools.partial(calls[mode], method)
        how = collect_mode(worker_cls, method)
        if how == "list" or mode == "rank0":
            return call

        def collected(*args: Any, **kwargs: Any) -> Any:
            return collect_results(call(*args, **kwargs), how)

        return collected

    def at(self, rank: int) -> RankCalls:
        """The non-blocking form on one rank: ``cluster.at(r).method(...)`` starts the worker
        method on rank r and returns a concurrent.futures.Future (errors surface from
        ``future.result()``, a worker's RollError as itself, a dead rank named)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.name} has ranks 0..{self.world_size - 1}, not {rank}")
        return RankCalls(self, rank)

    def run_scatter(self, method: str, items: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on rank r with `items[r]` (one item per rank); results in rank order."""
        if len(items) != self.world_size:
            raise ValueError(
                f"{self.name}.{method}: {len(items)} items for {self.world_size} ranks"
            )
        return self._gather(
            [
                h.submit(method, item, *args, **kwargs)
                for h, item in zip(self.handles, items, strict=True)
            ]
        )

    def run_one(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on one rank only and wait (not for collective methods)."""
        return self._gather([self.handles[rank].submit(method, *args, **kwargs)])[0]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        return self._gather([h.submit(method, *args, **kwargs) for h in self.handles])

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Rank 0's result. In a process group every rank is called (the method may be a
        collective: gathering sharded weights, exporting, generating with a sharded model)."""
        if self.distributed and self.world_size > 1:
            return self.run(method, *args, **kwargs)[0]
        return self.run_one(0, method, *args, **kwargs)

    def submit(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Future:
        """Start `method` on one rank without waiting: a concurrent.futures.Future.

        Used by the rollout scheduler to keep every rank busy while results stream back.
        Errors surface from `future.result()` (a worker's RollError as itself).
        """
        return chain_future(self.handles[rank].submit_async(method, *args, **kwargs), self._named)

    def run_dp(self, method: str, batch: Batch, **kwargs: Any) -> list[Any]:
        """Split `batch` into one contiguous shard per rank and call `method` on each.

        Shards have near-equal real-token counts (attention_mask sums) when the batch has an
        attention mask, else near-equal row counts; results come back in rank order, so
        concatenating them gives the batch's order."""
        shards = split_by_tokens(batch, self.world_size)
        futures = [
            h.submit(method, shard, **kwargs) for h, shard in zip(self.handles, shards, strict=True)
        ]
        return self._gather(futures)


class RankCalls:
    """`cluster.at(rank)`: every @dispatch method of the worker, on that rank, non-blocking."""

    def __init__(self, cluster: Cluster, rank: int) -> None:
        self._cluster = cluster
        self._rank = rank

    def __getattr__(self, method: str) -> Callable[..., Future]:
        cluster = self._cluster
        if method.startswith("_") or dispatch_mode(cluster.worker_cls, method) is None:
            raise AttributeError(
                f"{cluster.worker_cls.__name__}.{method} is not a cluster method (no @dispatch)"
            )
        return functools.partial(cluster.submit, self._rank, method)


def _rank_resources(
    resources: Mapping[str, float] | None,
    gpu_ids: list[tuple[int, ...]] | None,
    rank: int,
    gpus_per_node: int,
) -> dict[str, Any]:
    out: dict[str, Any] = dict(resources or {})
    if gpu_ids is not None:
        out["gpu_ids"] = tuple(gpu_ids[rank])
        out["gpus_per_node"] = gpus_per_node
        out["num_nodes"] = 1 + max(g for ids in gpu_ids for g in ids) // gpus_per_node
    return out
