"""Shared parts of the agentic token-in/token-out tests (text and images): an hf inference
rank and an fp32 torch trainer on the same local model directory."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from roll_core.backends.train import TorchTrainBackend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.config.schema import OptimConfig
from roll_core.engine import Cluster
from roll_core.engine.executors import LocalExecutor
from roll_core.workers.actor_infer import ActorInfer


def _hf_infer(model_path: str) -> Cluster:
    cluster = Cluster(
        "actor_infer",
        ActorInfer,
        LocalExecutor(),
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": {"model_path": model_path, "device": "cpu", "num_threads": 1},
        },
    )
    cluster.run("setup")
    return cluster


def _fp32_trainer(model_path: str) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=model_path,
            device="cpu",
            precision="fp32",
            optim=OptimConfig(),
            total_steps=1,
            micro_batch_size=4,
            num_threads=1,
        )
    )


@pytest.fixture(scope="session")
def hf_infer() -> Callable[[str], Cluster]:
    """`hf_infer(model_path)`: one set-up hf inference rank (local executor, CPU, 1 thread)."""
    return _hf_infer


@pytest.fixture(scope="session")
def fp32_trainer() -> Callable[[str], TorchTrainBackend]:
    """`fp32_trainer(model_path)`: a torch train backend in fp32 (micro-batches of 4)."""
    return _fp32_trainer
