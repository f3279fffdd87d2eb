"""Cluster dispatch reads the same with the local and the Ray executor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from roll_core.data import Batch
from roll_core.engine import Cluster, LocalExecutor, Worker
from roll_core.engine.executors import make_executor
from roll_core.engine.worker import dispatch
from roll_core.errors import DataError


class Summer(Worker):
    def __init__(self, *, offset: int = 0, **rank_info) -> None:
        super().__init__(**rank_info)
        self.offset = offset

    def total(self, batch: Batch) -> tuple[int, int]:
        return self.rank, int(batch["x"].sum()) + self.offset

    def fail(self) -> None:
        raise DataError("bad rows")


def test_local_run_dp_splits_contiguously() -> None:
    cluster = Cluster("s", Summer, LocalExecutor(), world_size=2, worker_kwargs={"offset": 100})
    batch = Batch(tensors={"x": torch.arange(5)}, non_tensors={}, meta={})
    # shards [0,1,2] and [3,4] -> sums 3 and 7, plus offset 100
    assert cluster.run_dp("total", batch) == [(0, 103), (1, 107)]
    assert cluster.run("ping") == [0, 1]


def test_private_methods_are_not_callable() -> None:
    cluster = Cluster("s", Summer, LocalExecutor())
    with pytest.raises(AttributeError):
        cluster.run("_secret")


@pytest.mark.ray
def test_ray_executor_same_results_and_errors() -> None:
    from roll_core.engine import RayExecutor

    ex = RayExecutor(num_cpus=2)
    try:
        cluster = Cluster("s", Summer, ex, world_size=2, worker_kwargs={"offset": 100})
        batch = Batch(tensors={"x": torch.arange(5)}, non_tensors={}, meta={})
        assert cluster.run_dp("total", batch) == [(0, 103), (1, 107)]
        with pytest.raises(DataError, match="bad rows"):
            cluster.run("fail")
    finally:
        ex.shutdown()


class Declared(Worker):
    """Each method says once how a cluster calls it."""

    @dispatch("dp")
    def rows(self, batch: Batch) -> tuple[int, int]:
        return self.rank, len(batch)

    @dispatch("all")
    def hello(self, word: str) -> str:
        return f"{word} from {self.rank}"

    @dispatch("rank0")
    def leader(self) -> int:
        return 100 + self.rank

    @dispatch("scatter")
    def take(self, item: int) -> int:
        return item * 10 + self.rank

    def undeclared(self) -> None: ...


def test_methods_dispatch_as_they_declare() -> None:
    cluster = Cluster("d", Declared, LocalExecutor(), world_size=2)
    batch = Batch(tensors={"x": torch.arange(5)}, non_tensors={}, meta={})
    assert cluster.rows(batch) == [(0, 3), (1, 2)]  # split 3 + 2 rows, rank order
    assert cluster.hello("hi") == ["hi from 0", "hi from 1"]
    assert cluster.leader() == 100  # rank 0's answer only
    assert cluster.take([1, 2]) == [10, 21]  # item r to rank r
    with pytest.raises(ValueError, match="2 ranks"):
        cluster.take([1])
    with pytest.raises(AttributeError, match="no @dispatch"):
        cluster.undeclared()
    with pytest.raises(AttributeError):
        cluster._private()


class _Gate(Worker):
    """A worker whose `wait` calls block until `open` (a concurrent call) lets them go."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        import threading

        self.event = threading.Event()

    @dispatch("one", concurrent=True)
    def wait(self, tag: int) -> int:
        assert self.event.wait(60), "open() never got through while wait() calls were blocked"
        return tag * 10 + self.rank

    @dispatch("all", concurrent=True)
    def open(self) -> None:
        self.event.set()


@pytest.mark.parametrize("kind", ["local", "ray"])
def test_concurrent_methods_run_beside_blocked_calls(kind: str) -> None:
    """Three `wait` calls block on rank 1; `open` (also concurrent) gets through and frees
    them; `cluster.at(rank)` is the non-blocking form; a "one" method is refused as
    `cluster.method`."""
    executor = make_executor(kind, num_cpus=2)
    try:
        cluster = Cluster("gate", _Gate, executor, world_size=2)
        futures = [cluster.at(1).wait(k) for k in range(3)]
        assert not any(f.done() for f in futures)
        cluster.open()
        assert [f.result(timeout=60) for f in futures] == [1, 11, 21]
        with pytest.raises(AttributeError, match=r"cluster.at\(rank\).wait"):
            cluster.wait(0)
        with pytest.raises(IndexError):
            cluster.at(2)
    finally:
        executor.shutdown()


class Collected(Worker):
    """Methods that also declare how their per-rank results come back."""

    @dispatch("dp", collect="concat")
    def doubled(self, batch: Batch) -> torch.Tensor:
        return batch["x"] * 2 + self.rank * 100

    @dispatch("dp", collect="concat")
    def parts(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"x": batch["x"], "rank": torch.full((len(batch),), self.rank)}

    @dispatch("dp", collect="metrics")
    def step(self, batch: Batch) -> dict[str, float]:
        n = float(len(batch))
        return {"loss_sum": n, "train/lr": 0.5 + self.rank, "wait_s": n, "gap_max": 10 - n}

    @dispatch("all", collect="rank0")
    def info(self) -> str:
        return f"rank {self.rank}"


def test_methods_collect_as_they_declare() -> None:
    cluster = Cluster("c", Collected, LocalExecutor(), world_size=2)
    batch = Batch(tensors={"x": torch.arange(5)}, non_tensors={}, meta={})
    # rows [0,1,2] on rank 0 and [3,4] on rank 1, joined back in batch order
    assert cluster.doubled(batch).tolist() == [0, 2, 4, 106, 108]
    parts = cluster.parts(batch)
    assert parts["x"].tolist() == [0, 1, 2, 3, 4]
    assert parts["rank"].tolist() == [0, 0, 0, 1, 1]
    # sums (3 + 2 rows), lr from rank 0, timings and maxima the largest (3 s; 10 - 2 = 8)
    assert cluster.step(batch) == {"loss_sum": 5.0, "train/lr": 0.5, "wait_s": 3.0, "gap_max": 8.0}
    assert cluster.info() == "rank 0"
    # the non-blocking form is one rank's own result, never collected
    assert cluster.at(1).step(batch).result()["loss_sum"] == 5.0
    assert cluster.at(1).info().result() == "rank 1"


def test_collect_is_refused_where_there_is_one_result() -> None:
    with pytest.raises(TypeError, match="one result"):
        dispatch("rank0", collect="concat")
    with pytest.raises(TypeError, match="one result"):
        dispatch("one", collect="metrics")


def test_collect_concat_refuses_other_results() -> None:
    from roll_core.engine.dispatch import collect_results

    assert collect_results([1, 2], "list") == [1, 2]
    with pytest.raises(TypeError, match="not int"):
        collect_results([1, 2], "concat")
    with pytest.raises(ValueError, match="unknown collect mode"):
        collect_results([1, 2], "sum")
