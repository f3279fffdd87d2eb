"""The Worker base class: role logic lives in subclasses (roll_core/workers/), which know
nothing about Ray. An executor creates one instance per rank."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

DispatchMode = Literal["all", "dp", "rank0", "scatter", "one"]
"""How `Cluster` calls a worker method (see :func:`dispatch`)."""

Collect = Literal["list", "concat", "metrics", "rank0"]
"""How `Cluster` returns the per-rank results of a method called on several ranks (see
:func:`dispatch` and roll_core/engine/dispatch.py `collect_results`)."""

F = TypeVar("F", bound=Callable[..., Any])
_DISPATCH_ATTR = "__roll_dispatch__"
_CONCURRENT_ATTR = "__roll_concurrent__"
_COLLECT_ATTR = "__roll_collect__"


def dispatch(
    mode: DispatchMode, *, collect: Collect = "list", concurrent: bool = False
) -> Callable[[F], F]:
    """Declare, once on the worker method, how ``cluster.method(...)`` calls it:

    * ``all``: every rank with the same arguments; the results in rank order (setup, save);
    * ``dp``: the first argument is a Batch split over the ranks by token count; the per-rank
      results in rank order, so concatenating them gives the batch's order (train_step);
    * ``rank0``: rank 0's result; in a process group every rank is called, as the method may
      be a collective (export, gathering sharded weights);
    * ``scatter``: the first argument is a list with one item per rank, rank r gets item r;
    * ``one``: the caller picks the rank, ``cluster.at(rank).method(...)``, and gets a
      ``concurrent.futures.Future`` (the router sending one request to one inference rank).

    ``collect`` declares what ``cluster.method(...)`` returns for the modes that call several
    ranks (``all``, ``dp``, ``scatter``):

    * ``list`` (the default): the per-rank results in rank order;
    * ``concat``: one value in batch order, the per-rank tensors (or Batches, or dicts of
      tensors) concatenated along the first dimension (``dp`` log-probs, values);
    * ``metrics``: one metrics dict, ``reduce_rank_metrics`` of the per-rank dicts (sums,
      except global values from rank 0, timings and maxima: the largest);
    * ``rank0``: rank 0's result (every rank still runs: setup, a collective).

    Every method also has the non-blocking form ``cluster.at(rank).method(...)`` (one rank's
    own result, never collected).
    ``concurrent=True``: calls may run while other calls to the same rank are in flight (a
    request-level engine serves many blocked ``generate_request`` calls at once; ``abort``
    must get through while they wait). Such calls run on their own threads (a Ray concurrency
    group, a thread pool under the local executor); every other call to a rank runs in order.
    """

    if collect != "list" and mode in ("rank0", "one"):
        raise TypeError(f"@dispatch({mode!r}, collect={collect!r}): a {mode} method has one result")

    def mark(fn: F) -> F:
        vars(fn)[_DISPATCH_ATTR] = mode
        vars(fn)[_COLLECT_ATTR] = collect
        vars(fn)[_CONCURRENT_ATTR] = concurrent
        return fn

    return mark


def dispatch_mode(worker_cls: type, method: str) -> DispatchMode | None:
    """The mode `method` of `worker_cls` was declared with (None: not a cluster method)."""
    return vars(getattr(worker_cls, method, dispatch_mode)).get(_DISPATCH_ATTR)


def collect_mode(worker_cls: type, method: str) -> Collect:
    """How the per-rank results of `method` are returned (``list`` unless declared)."""
    return vars(getattr(worker_cls, method, dispatch_mode)).get(  # type: ignore[no-any-return]
        _COLLECT_ATTR, "list"
    )


def is_concurrent(worker_cls: type, method: str) -> bool:
    """Whether `method` was declared ``@dispatch(..., concurrent=True)``."""
    return bool(vars(getattr(worker_cls, method, dispatch_mode)).get(_CONCURRENT_ATTR, False))


def has_concurrent_methods(worker_cls: type) -> bool:
    """Whether any public method of `worker_cls` is declared concurrent (the executor then
    gives its ranks a pool of threads for them)."""
    return any(is_concurrent(worker_cls, name) for name in dir(worker_cls) if name[0] != "_")


CONCURRENT_CALLS = 512
"""How many concurrent calls one rank serves at once (threads of its concurrency group)."""


class Worker:
    """One rank of a role. Subclasses take their settings as keyword arguments."""

    def __init__(self, *, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        """Whether the ranks of a cluster of this class form a torch.distributed group.

        Such ranks each run in their own process (a subprocess under the local executor, a
        Ray actor under Ray); the cluster calls `dist_endpoint` on rank 0 and then
        `init_process_group` on every rank before anything else.
        """
        return False

    @dispatch("all")
    def ping(self) -> int:
        """Cheap call used to wait until a remote worker is up."""
        return self.rank

    @dispatch("all")
    def read_shared(self, path: str) -> tuple[str, str | None]:
        """(this rank's host name, the text of `path` as this rank reads it, or None where it
        cannot): whether the rank shares the driver's filesystem at that path."""
        try:
            text: str | None = Path(path).read_text()
        except OSError:
            text = None
        return socket.gethostname(), text

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a public method by name (the executors' single entry point)."""
        if method.startswith("_"):
            raise AttributeError(f"{type(self).__name__}.{method} is private")
        return getattr(self, method)(*args, **kwargs)

    # ---- torch.distributed ------------------------------------------------------------------
    def dist_endpoint(self) -> tuple[str, int]:
        """(address, free TCP port) of this rank's host: the rendezvous of the group."""
        host = os.environ.get("ROLL_MASTER_ADDR") or _node_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return host, port

    def init_process_group(self, address: str, port: int, backend: str = "auto") -> str:
        """Join the cluster's group (`auto`: nccl when this process sees a GPU, else gloo)."""
        import torch
        import torch.distributed as dist

        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        os.environ.update(
            MASTER_ADDR=address,
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # every rank sees its own device(s) as 0 (CUDA_VISIBLE_DEVICES)
        )
        if not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{address}:{port}",
                rank=self.rank,
                world_size=self.world_size,
            )
        return backend

    def destroy_process_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _node_ip() -> str:
    """This host's address as other nodes see it (Ray's view when Ray runs us)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a core dependency
        pass
    return "127.0.0.1"
