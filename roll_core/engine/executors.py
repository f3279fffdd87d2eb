"""Executors: `local` (every worker in this process, or in a subprocess per rank when the ranks
form a torch.distributed group) and `ray` (one Ray actor per rank)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from roll_core.engine.process import ProcessHandle, chain_future
from roll_core.engine.worker import CONCURRENT_CALLS, Worker, has_concurrent_methods, is_concurrent
from roll_core.errors import ConfigError, RollError, WorkerDiedError

_DEATH_GRACE_S = 10.0
"""How long a failed gather waits for the other ranks, to report a death before its echoes."""


class _LocalHandle:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._pool: ThreadPoolExecutor | None = None
        self._concurrent: ThreadPoolExecutor | None = None

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.worker.call(method, *args, **kwargs)

    def submit_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run the call on this rank's own thread (calls to one rank stay in order), or, for a
        method declared concurrent, on a pool of threads beside it."""
        if is_concurrent(type(self.worker), method):
            if self._concurrent is None:
                self._concurrent = ThreadPoolExecutor(
                    max_workers=CONCURRENT_CALLS, thread_name_prefix="roll-worker-concurrent"
                )
            return self._concurrent.submit(self.worker.call, method, *args, **kwargs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roll-worker")
        return self._pool.submit(self.worker.call, method, *args, **kwargs)


class LocalExecutor:
    """Runs workers in the driver process: the debug mode and the single-device mode.

    Ranks that form a torch.distributed group (`isolated=True`) each get a spawned
    subprocess instead (roll_core/engine/process.py); nothing else changes for the caller.
    """

    name = "local"

    def __init__(self) -> None:
        self._processes: list[ProcessHandle] = []

    def spawn(
        self,
        worker_cls: type[Worker],
        *,
        rank: int,
        world_size: int,
        resources: Mapping[str, Any],
        kwargs: dict[str, Any],
        isolated: bool = False,
    ) -> _LocalHandle | ProcessHandle:
        if isolated:
            env = {}
            if "gpu_ids" in resources:  # one machine: global ids are this machine's ids
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in resources["gpu_ids"])
            handle = ProcessHandle(
                worker_cls, {"rank": rank, "world_size": world_size, **kwargs}, env=env
            )
            self._processes.append(handle)
            return handle
        return _LocalHandle(worker_cls(rank=rank, world_size=world_size, **kwargs))

    def gather(self, futures: list[Any]) -> list[Any]:
        pending = [f for f in futures if isinstance(f, Future)]
        done, _ = wait(pending, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            # A rank that died makes its peers in a collective fail too, often first: wait a
            # moment for every rank and report the death, the cause, before their errors.
            done, _ = wait(pending, timeout=_DEATH_GRACE_S)
            errors = [e for f in done if (e := f.exception()) is not None]
            raise next((e for e in errors if isinstance(e, WorkerDiedError)), errors[0])
        return [f.result() if isinstance(f, Future) else f for f in futures]

    def shutdown(self) -> None:
        # After a death the survivors' group is broken: do not wait long for a polite stop.
        broken = any(not handle.alive for handle in self._processes)
        for handle in self._processes:
            handle.close(timeout=2.0 if broken else 30.0)
        self._processes.clear()


class _RayHandle:
    def __init__(self, actor: Any, rank: int, worker_cls: type[Worker] = Worker) -> None:
        self.actor = actor
        self.rank = rank
        self.worker_cls = worker_cls

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if is_concurrent(self.worker_cls, method):  # its own threads (concurrency group)
            call = self.actor.call.options(concurrency_group=_CONCURRENT_GROUP)
            return call.remote(method, *args, **kwargs)
        return self.actor.call.remote(method, *args, **kwargs)

    def submit_async(self, method: str, *args: Any, **kwargs: Any) -> Future:
        from ray.exceptions import RayActorError

        def died(err: BaseException) -> BaseException:
            if isinstance(err, RayActorError):
                return WorkerDiedError("", self.rank, f"Ray actor {type(err).__name__}")
            return err

        return chain_future(self.submit(method, *args, **kwargs).future(), died)


_CONCURRENT_GROUP = "concurrent"
"""The Ray concurrency group of the methods declared ``@dispatch(..., concurrent=True)``;
every other call runs in the actor's default group, one at a time, in order."""


class RayExecutor:
    """One Ray actor per rank; starts a local Ray cluster unless `address` names one."""

    name = "ray"

    def __init__(self, *, address: str | None = None, num_cpus: int | None = None) -> None:
        import ray

        self._ray = ray
        self._started_here = False
        self._ranks: dict[str, int] = {}  # actor id -> rank, to name a dead actor
        if not ray.is_initialized():
            os.environ.setdefault("RAY_DEDUP_LOGS", "0")
            if not address:
                # roll runs only actors (each in its own process): Ray's pool of idle task
                # workers, one per CPU at start-up, would each import Ray for nothing
                os.environ.setdefault("RAY_enable_worker_prestart", "0")
                os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
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
        resources: Mapping[str, Any],
        kwargs: dict[str, Any],
        isolated: bool = False,
    ) -> _RayHandle:
        options: dict[str, Any] = {
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            "name": None,
        }
        env_vars = {"TOKENIZERS_PARALLELISM": "false"}
        if "gpu_ids" in resources:
            # Pin the rank to its GPUs: the bundle of its node in one placement group over the
            # cluster (one bundle of gpus_per_node GPUs per node), a token GPU share so Ray
            # packs colocated roles on the same GPUs, and CUDA_VISIBLE_DEVICES set by us.
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            ids = tuple(int(g) for g in resources["gpu_ids"])
            per_node = int(resources["gpus_per_node"])
            pg = self._placement_group(int(resources["num_nodes"]), per_node)
            options["num_gpus"] = 0.01
            options["num_cpus"] = 0
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=ids[0] // per_node
            )
            env_vars["CUDA_VISIBLE_DEVICES"] = ",".join(str(g % per_node) for g in ids)
            env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if isolated or "gpu_ids" in resources:
            options["runtime_env"] = {"env_vars": env_vars}
        self._check_cpus(float(options["num_cpus"]))
        # concurrency groups cannot be given in `.options()`: only to `ray.remote`
        groups = {_CONCURRENT_GROUP: CONCURRENT_CALLS} if has_concurrent_methods(worker_cls) else {}
        actor_cls = (
            self._ray.remote(concurrency_groups=groups)(worker_cls)  # type: ignore[call-overload]
            if groups
            else self._ray.remote(worker_cls)
        )
        actor: Any = actor_cls.options(**options).remote(rank=rank, world_size=world_size, **kwargs)
        self._ranks[actor._actor_id.hex()] = rank
        return _RayHandle(actor, rank, worker_cls)

    def _check_cpus(self, cpus: float) -> None:
        """Refuse an actor the cluster can never hold (its CPUs all taken by our own actors)
        instead of waiting for it forever."""
        self._cpus_held = getattr(self, "_cpus_held", 0.0) + cpus
        total = float(self._ray.cluster_resources().get("CPU", 0.0))
        if cpus and self._cpus_held > total:
            raise ConfigError(
                f"the run's Ray actors need {self._cpus_held:g} CPUs in all (1 per rank), but "
                f"the Ray cluster has {total:g}; the next one would wait for resources forever.",
                hint="Lower the world_size of a role, raise executor.num_cpus, or join a larger "
                "cluster with executor.ray_address.",
            )

    def _placement_group(self, num_nodes: int, gpus_per_node: int) -> Any:
        """One placement group for the whole run: bundle k = all GPUs of node k."""
        key = (num_nodes, gpus_per_node)
        pgs: dict[tuple[int, int], Any] = self.__dict__.setdefault("_pgs", {})
        if key not in pgs:
            from ray.util.placement_group import placement_group

            bundles = [{"GPU": float(gpus_per_node), "CPU": 1.0} for _ in range(num_nodes)]
            pg = placement_group(bundles, strategy="STRICT_SPREAD" if num_nodes > 1 else "PACK")
            try:
                self._ray.get(pg.ready(), timeout=600)
            except Exception as err:  # noqa: BLE001 - GetTimeoutError and friends
                raise ConfigError(
                    f"Ray could not reserve {num_nodes} node(s) x {gpus_per_node} GPUs ({err}).",
                    hint="Check `ray status`, executor.num_gpus and executor.gpus_per_node.",
                ) from None
            pgs[key] = pg
        return pgs[key]

    def gather(self, futures: list[Any]) -> list[Any]:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return self._ray.get(futures)
        except RayActorError as err:
            raise self.death(err) from None
        except RayTaskError as err:
            # A peer's death makes the survivors of a collective fail too: report the death.
            dead = self._first_death(futures)
            if dead is not None:
                raise dead from None
            # A user-fixable error inside a worker surfaces as itself, not as a Ray traceback.
            if isinstance(err.cause, RollError):
                raise err.cause from None
            raise

    def death(self, err: Any) -> WorkerDiedError:
        """A dead Ray actor (RayActorError) as a WorkerDiedError naming its rank."""
        actor_id = getattr(err, "actor_id", None)
        rank = self._ranks.get(actor_id, -1) if isinstance(actor_id, str) else -1
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return WorkerDiedError("", rank, f"Ray actor {type(err).__name__}: {first[:300]}")

    def _first_death(self, futures: list[Any]) -> WorkerDiedError | None:
        from ray.exceptions import RayActorError

        ready, _ = self._ray.wait(futures, num_returns=len(futures), timeout=_DEATH_GRACE_S)
        for ref in ready:
            try:
                self._ray.get(ref)
            except RayActorError as err:
                return self.death(err)
            except Exception:  # noqa: BLE001 - only deaths matter here
                continue
        return None

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
