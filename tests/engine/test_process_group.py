"""Clusters whose ranks form a torch.distributed group: one subprocess per rank under the
local executor, a gloo group on CPU, errors that come back as themselves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from roll_core.data import Batch
from roll_core.engine import Cluster, LocalExecutor, Worker
from roll_core.engine.process import WorkerProcessError
from roll_core.errors import DataError


class Reducer(Worker):
    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict) -> bool:
        return True

    def all_reduce(self, x: float) -> float:
        t = torch.tensor([x * (self.rank + 1)])
        dist.all_reduce(t)  # sum over ranks
        return float(t)

    def rows(self, batch: Batch) -> list[int]:
        return batch["x"].tolist()

    def pid(self) -> int:
        import os

        return os.getpid()

    def fail(self) -> None:
        raise DataError("bad rows", hint="fix them")

    def crash(self) -> None:
        raise ZeroDivisionError("boom")


def test_two_ranks_in_their_own_processes_form_a_gloo_group() -> None:
    import os

    ex = LocalExecutor()
    try:
        c = Cluster("r", Reducer, ex, world_size=2)
        assert c.dist_backend == "gloo"
        pids = c.run("pid")
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert c.run("all_reduce", 2.0) == [6.0, 6.0]  # 2*1 + 2*2 on both ranks
        assert c.run_rank0("all_reduce", 1.0) == 3.0  # collective: every rank is called
        # tokens 3, 1, 1, 1 (half 3): rank 0 gets the long row alone
        mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]])
        batch = Batch(tensors={"x": torch.arange(4), "attention_mask": mask})
        assert c.run_dp("rows", batch) == [[0], [1, 2, 3]]
        with pytest.raises(DataError, match="bad rows"):
            c.run("fail")
        with pytest.raises(WorkerProcessError, match="ZeroDivisionError: boom"):
            c.run_one(1, "crash")
        assert c.run("all_reduce", 1.0) == [3.0, 3.0]  # still usable after an error
    finally:
        ex.shutdown()
