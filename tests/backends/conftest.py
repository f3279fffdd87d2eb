"""vLLM engines shared by the backend test modules.

An engine start costs ~30 s on 2 cores (more when loaded). test_vllm.py (request mode),
test_vllm_engine.py (request mode against batch-mode references) and test_vllm_engine_batch.py
(batch mode) all serve the same tiny model with the same options, so each mode starts once per
session: ``vllm_request`` is a real ActorInfer rank on a local Cluster (its backend is the
request-mode engine), ``vllm_batch`` a ``serving="batch"`` backend. Tests that change the
weights put them back (each weight-sync test restores the original tensors, version 0).

Each shared engine is closed right after the last collected test that uses it (see
``pytest_runtest_teardown``), not at the end of the session, so its processes and KV cache do
not stay behind for the rest of the suite."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from roll_core.models import materialize_builtin

# one set of engine options for every shared engine (and for the tests' own engines)
VLLM_OPTS = dict(num_threads=1, dtype="float32", sync_bucket_mb=1, cpu_kv_cache_gb=0.25)
SHARED = ("vllm_request", "vllm_batch")
_closers: dict[str, Callable[[], None]] = {}
_last_user: dict[str, str] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record, for each shared engine, the last selected test that needs it."""
    for item in session.items:
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name in SHARED:
        if _last_user.get(name) == item.nodeid and name in _closers:
            _closers.pop(name)()


def _register(name: str, close: Callable[[], None]) -> Callable[[], None]:
    done: list[bool] = []

    def once() -> None:
        if not done:
            done.append(True)
            close()

    _closers[name] = once
    return once


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("vllm-cache")))


@pytest.fixture(scope="session")
def vllm_request(vllm_model_dir: str):
    """A real ActorInfer rank on a local Cluster; its backend is the request-mode engine."""
    from roll_core.engine import Cluster
    from roll_core.engine.executors import LocalExecutor
    from roll_core.workers.actor_infer import ActorInfer

    torch.set_num_threads(1)
    executor = LocalExecutor()
    kwargs = {"backend": "vllm", "backend_kwargs": {"model_path": vllm_model_dir, **VLLM_OPTS}}
    cluster = Cluster("actor_infer", ActorInfer, executor, worker_kwargs=kwargs)
    cluster.setup()
    assert cluster.handles[0].worker.backend.serving == "request"  # the default

    def close() -> None:
        cluster.handles[0].worker.backend.close()
        executor.shutdown()

    close_once = _register("vllm_request", close)
    yield cluster
    close_once()


@pytest.fixture(scope="session")
def vllm_batch(vllm_model_dir: str):
    """The fixed-batch mode (``vllm.LLM``) on the same model and options."""
    from roll_core.backends.infer import make_infer_backend

    torch.set_num_threads(1)
    backend = make_infer_backend("vllm", model_path=vllm_model_dir, serving="batch", **VLLM_OPTS)
    assert type(backend.llm).__name__ == "LLM"  # type: ignore[attr-defined]
    close_once = _register("vllm_batch", backend.close)  # type: ignore[attr-defined]
    yield backend
    close_once()
