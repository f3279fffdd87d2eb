"""Weight sync between actor_train and actor_infer: the driver's side (the control plane).

The driver never touches a weight. It asks every rank where it lives, picks the path, has the
ranks join one group (roll_core/backends/sync_transport.py) and then, at each sync, only says
"send" to the training ranks and "receive, stamp version v" to the inference ranks; the
tensors go rank to rank. Paths (`sync.path`):

* ``same_process`` (picked by ``auto`` only): sender and every receiver are objects in this
  very process (executor ``local``, one torch rank, hf ranks): each parameter is copied in
  place into the inference model, no packing, no group.
* ``shared_memory``: every member on one host: the sender packs buckets into ``/dev/shm``
  (``cuda_ipc``: a CUDA buffer shared by IPC handle when every receiver is on the sender's
  own GPU) and the receivers copy from it.
* ``broadcast``: a gloo (CPU) or NCCL (all on CUDA) broadcast of each bucket.
* ``driver``: the old path, kept as an explicit fallback: rank 0 gathers every weight and
  returns CPU copies to the driver, which sends them to every inference rank.

``auto`` picks same_process > shared_memory (cuda_ipc) > broadcast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roll_core.engine.cluster import Cluster
from roll_core.errors import RollError, WorkerDiedError

if TYPE_CHECKING:
    from roll_core.config.rlvr import RLConfig
    from roll_core.engine.resource_plan import GpuPlan

PATHS = ("auto", "broadcast", "shared_memory", "driver")
"""What `sync.path` may name."""


@dataclass(frozen=True)
class SyncSettings:
    """`sync.path`, `sync.bucket_mb`, `sync.timeout_s` (see roll_core/config/rlvr.py)."""

    path: str = "auto"
    bucket_mb: float = 256.0
    timeout_s: float = 600.0
    share: bool = False
    """`same_process` only: the inference model takes the trainer's parameter storage instead
    of a copy (one model in memory) where name, dtype, shape and device match. Only safe when
    nothing generates while the trainer updates and nothing offloads (the role builder
    decides: synchronous rollout, no offload)."""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


def choose_path(
    requested: str,
    sender: dict[str, Any],
    receivers: Sequence[dict[str, Any]],
    *,
    driver_pid: int,
    shm_needed: int = 0,
) -> str:
    """The path a sync takes, from `sync.path` and where the members live (`endpoint()`
    dicts: host, boot id, pid, device, free /dev/shm bytes). Returns one of driver,
    same_process, shared_memory, cuda_ipc, broadcast; raises RollError when `shared_memory`
    is asked across hosts. `auto` takes broadcast instead of CPU shared memory when the
    sender's /dev/shm has less than `shm_needed` bytes free (e.g. Docker's 64 MiB default)."""
    if requested not in PATHS:
        raise RollError(f"sync.path: unknown path {requested!r}; valid: {', '.join(PATHS)}.")
    if requested in ("driver", "broadcast"):
        return requested
    same_process = all(m["pid"] == driver_pid for m in [sender, *receivers])
    elsewhere = [
        i
        for i, r in enumerate(receivers)
        if (r["host"], r["boot"]) != (sender["host"], sender["boot"])
    ]
    if requested == "shared_memory" and elsewhere:
        raise RollError(
            f"sync.path=shared_memory, but actor_infer receiver(s) {elsewhere} run on another "
            f"host than actor_train rank 0 ({sender['host']}): shared memory needs one host.",
            hint="Set sync.path=auto (broadcast across hosts) or sync.path=broadcast.",
        )
    if requested == "auto" and same_process:
        return "same_process"
    if elsewhere:
        return "broadcast"
    if all(m["device"] == "cuda" for m in [sender, *receivers]):
        # an IPC handle opens only on the GPU it came from (each rank sees its own GPUs):
        # receivers on other GPUs of the host get an NCCL broadcast
        same_gpu = all(r.get("gpu") == sender.get("gpu") for r in receivers)
        if same_gpu or requested == "shared_memory":
            return "cuda_ipc"
        return "broadcast"
    if requested == "auto" and sender.get("shm_free", 0) < shm_needed:
        return "broadcast"
    return "shared_memory"


def group_backend(path: str, members: Sequence[dict[str, Any]]) -> str:
    """nccl for a broadcast among CUDA members only; gloo otherwise (the shared paths use
    the group only for small messages and acks)."""
    if path == "broadcast" and all(m["device"] == "cuda" for m in members):
        return "nccl"
    return "gloo"


def attach_weight_sync(train: Cluster, infer: Cluster, settings: SyncSettings) -> WeightSync:
    """The sync from `train` into `infer` (the pipelines' role builder keeps it in
    `RLRoles.weight_sync`); it plans its path at the first sync."""
    return WeightSync(train, infer, settings)


class WeightSync:
    """actor_train -> actor_infer, planned once, run at every policy version."""

    def __init__(self, train: Cluster, infer: Cluster, settings: SyncSettings) -> None:
        self.train, self.infer, self.settings = train, infer, settings
        self.path: str | None = None
        self.backend: str | None = None
        """The group's collective backend (gloo / nccl); None on the paths without a group."""
        self.ranks = 0
        """Members of the sync: actor_train rank 0 and every inference engine rank."""
        self._joined = False

    # ---- planning ---------------------------------------------------------------------------
    def connect(self) -> str:
        """Ask the members where they live, pick the path and (for the group paths) have
        them all join the group at once. Returns the path."""
        s = self.settings
        if s.path == "driver":
            self.path, self.ranks = "driver", 1 + self.infer.world_size
            return self.path
        sender = self.train.at(0).sync_endpoint().result()
        per_rank: list[list[dict[str, Any]]] = self.infer.sync_endpoints()
        receivers = [ep for eps in per_rank for ep in eps]
        self.ranks = 1 + len(receivers)
        path = choose_path(
            s.path, sender, receivers, driver_pid=os.getpid(), shm_needed=s.bucket_bytes
        )
        if path == "same_process" and not (_local(self.train) and _local(self.infer)):
            path = "shared_memory"
        self.path = path
        if path == "same_process":
            return path
        host, port = self.train.run_one(0, "dist_endpoint")
        self.backend = group_backend(path, [sender, *receivers])
        common = dict(
            host=host,
            port=port,
            world_size=self.ranks,
            backend=self.backend,
            timeout_s=s.timeout_s,
            mode=path,
        )
        futures = [self.train.at(0).sync_join(group_rank=0, **common)]
        first = 1
        for r, eps in enumerate(per_rank):
            futures.append(self.infer.at(r).sync_join(group_rank=first, **common))
            first += len(eps)
        labels = ["actor_train rank 0"] + [f"actor_infer rank {r}" for r in range(len(per_rank))]
        self._wait(futures, labels, "joining the weight-sync group")
        self._joined = True
        return path

    def describe(self) -> dict[str, Any]:
        """What a run records of its sync (meta.json ``weight_sync``, the start-up line): the
        path taken (`connect` must have run), what `sync.path` asked for, the group backend,
        the ranks, the bucket size."""
        return {
            "path": self.path,
            "requested": self.settings.path,
            "backend": self.backend,
            "ranks": self.ranks,
            "bucket_mb": self.settings.bucket_mb,
            "shared": self.path == "same_process" and self.settings.share,
        }

    # ---- one sync ---------------------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """Send the current policy to every inference rank and stamp `version` there."""
        start = time.perf_counter()
        if self.path is None or (self.path not in ("driver", "same_process") and not self._joined):
            self.connect()
        if self.path == "driver":
            stats = self._driver(version)
        elif self.path == "same_process":
            stats = self._same_process(version)
        else:
            stats = self._group(version)
        return {
            "sync/seconds": time.perf_counter() - start,
            "sync/bytes": float(stats["bytes"]),
            "sync/buckets": float(stats["buckets"]),
            "sync/tensors": float(stats["tensors"]),
        }

    def _driver(self, version: int) -> dict[str, int]:
        weights = self.train.named_weights()
        self.infer.update_weights(weights, version=version)
        size = sum(t.numel() * t.element_size() for t in weights.values())
        return {"bytes": size, "buckets": 1, "tensors": len(weights)}

    def _same_process(self, version: int) -> dict[str, int]:
        sender = _worker(self.train, 0)
        receivers = [_worker(self.infer, r) for r in range(self.infer.world_size)]
        size = count = 0
        share = self.settings.share
        for name, tensor in sender.sync_tensors(self.settings.bucket_bytes):
            for receiver in receivers:
                receiver.load_sync_bucket([(name, tensor)], share=share)
            size += tensor.numel() * tensor.element_size()
            count += 1
        for receiver in receivers:
            receiver.finish_sync(version)
        return {"bytes": size, "buckets": count, "tensors": count}

    def _group(self, version: int) -> dict[str, int]:
        bucket = self.settings.bucket_bytes
        futures = [self.train.at(r).sync_send(bucket) for r in range(self.train.world_size)]
        futures += [
            self.infer.at(r).sync_receive(version=version) for r in range(self.infer.world_size)
        ]
        try:
            labels = [f"actor_train rank {r}" for r in range(self.train.world_size)]
            labels += [f"actor_infer rank {r}" for r in range(self.infer.world_size)]
            results = self._wait(futures, labels, f"the weight sync to policy version {version}")
        except BaseException:
            self._joined = False  # the group is broken: the next sync builds a new one
            raise
        sent = results[0]
        for r, got in enumerate(results[self.train.world_size :]):
            if got["tensors"] != sent["tensors"]:
                raise RollError(
                    f"weight sync: actor_infer rank {r} loaded {got['tensors']} tensors of "
                    f"{sent['tensors']} sent by actor_train rank 0."
                )
        return sent

    def _wait(self, futures: list[Future], labels: list[str], what: str) -> list[Any]:
        """Every future's result; on a failure, the death of a rank (named) before the errors
        it caused in its peers. No overall deadline (a large model may take longer than
        `sync.timeout_s` in all): every collective inside the ranks has that timeout, so a
        dead or stuck member makes the others fail within it."""
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            done, _ = wait(futures, timeout=min(10.0, self.settings.timeout_s))
            errors = [
                (label, e)
                for label, f in zip(labels, futures, strict=True)
                if f in done and (e := f.exception()) is not None
            ]
            death = next((e for _, e in errors if isinstance(e, WorkerDiedError)), None)
            if death is not None:
                raise death
            label, first = errors[0]
            if isinstance(first, RollError):
                raise first
            raise RollError(f"{what} failed on {label}: {first}") from first
        return [f.result() for f in futures]


def _local(cluster: Cluster) -> bool:
    return all(hasattr(h, "worker") for h in cluster.handles)


def _worker(cluster: Cluster, rank: int) -> Any:
    return cluster.handles[rank].worker  # type: ignore[attr-defined]


def planned_path(cfg: RLConfig, gp: GpuPlan | None) -> tuple[str, str]:
    """The path a recipe's sync will take, as `--dry-run` shows it, with a note; raises
    ConfigError for a path the recipe's placement cannot do (`shared_memory` with
    actor_train rank 0 and an inference rank on different nodes). The choice made at the
    start of a run (`WeightSync.connect`) follows the same rule, from where the ranks
    really run. `gp`: the recipe's `gpu_plan` (engine/plan.py calls this once per launch)."""
    from roll_core.errors import ConfigError

    s, train, infer, ex = cfg.sync, cfg.actor_train, cfg.actor_infer, cfg.executor
    note = f"buckets of {s.bucket_mb:g} MiB, timeout {s.timeout_s:g} s"
    if s.path == "driver":
        return "driver", "fallback: rank 0 gathers every weight, the driver sends them; " + note
    one_host: bool | None = ex.type == "local" or (ex.type == "ray" and not ex.ray_address)
    same_gpu = False
    if gp is not None and "actor_infer" in gp.placement.roles:
        per_node = ex.gpus_per_node
        sender_gpus = set(gp.placement.roles["actor_train"].ranks[0])
        same_gpu = all(set(ids) <= sender_gpus for ids in gp.placement.roles["actor_infer"].ranks)
        home = gp.placement.roles["actor_train"].ranks[0][0] // per_node
        nodes = {ids[0] // per_node for ids in gp.placement.roles["actor_infer"].ranks}
        one_host = nodes == {home}  # the placement names the node of every rank
        if not one_host and s.path == "shared_memory":
            raise ConfigError(
                f"sync.path=shared_memory, but the placement puts actor_train rank 0 on "
                f"node {home} and actor_infer ranks on node(s) {sorted(nodes - {home})}: "
                "shared memory needs one host.",
                hint="Set sync.path=auto (broadcast across nodes) or sync.path=broadcast.",
            )
    elif ex.type == "ray" and ex.ray_address:
        one_host = None  # a joined cluster: where the ranks land is known at the start
    gpu = gp is not None
    shared = "shared_memory (cuda_ipc)" if gpu else "shared_memory"
    bcast = f"broadcast ({'nccl' if gpu else 'gloo'})"
    if s.path == "broadcast":
        return bcast, note
    if gpu and one_host and not same_gpu and s.path == "auto":
        return bcast, "one host, but inference ranks on other GPUs than actor_train rank 0; " + note
    in_process = (
        ex.type == "local"
        and train.backend == "torch"
        and train.world_size == 1
        and infer.backend == "hf"
    )
    if s.path == "auto" and in_process:
        return "same_process", "trainer and inference in the driver; " + note
    if one_host is None:
        choice = shared if s.path == "shared_memory" else f"{shared} if one host, else {bcast}"
        return choice, "decided at the start from where the ranks run; " + note
    if s.path == "shared_memory" or one_host:
        return shared, "every rank on one host; " + note
    return bcast, "ranks on several hosts; " + note
