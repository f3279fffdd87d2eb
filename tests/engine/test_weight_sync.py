"""Weight sync actor_train -> actor_infer on the data plane (roll_core/engine/weight_sync.py,
sync_transport.py), on CPU with gloo: after a sync the inference weights are bitwise the
trainer's for every path and train backend, the driver never receives a weight, buckets
smaller than one tensor still work, and a receiver killed mid-transfer fails the sync with an
error naming it, within the timeout."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.config.schema import LoraConfig, OptimConfig
from roll_core.data import Batch
from roll_core.engine import Cluster, LocalExecutor
from roll_core.engine.weight_sync import (
    SyncSettings,
    WeightSync,
    attach_weight_sync,
    choose_path,
)
from roll_core.errors import RollError, WorkerDiedError
from roll_core.models import resolve_model_path
from roll_core.workers.actor_infer import ActorInfer
from roll_core.workers.actor_train import ActorTrain

HOST = {"host": "a", "boot": "b", "pid": 10, "device": "cpu", "shm_free": 2**30}


def test_choose_path_follows_where_the_ranks_live() -> None:
    other_pid = {**HOST, "pid": 11}
    other_host = {**HOST, "host": "z", "pid": 12}
    cuda = {**HOST, "device": "cuda"}
    assert choose_path("auto", HOST, [HOST, HOST], driver_pid=10) == "same_process"
    assert choose_path("auto", HOST, [other_pid], driver_pid=10) == "shared_memory"
    assert choose_path("auto", HOST, [HOST], driver_pid=99) == "shared_memory"
    assert choose_path("auto", cuda, [{**cuda, "pid": 11}], driver_pid=10) == "cuda_ipc"
    other_gpu = {**cuda, "pid": 11, "gpu": "GPU-2"}  # one host, another GPU: NCCL
    assert choose_path("auto", {**cuda, "gpu": "GPU-1"}, [other_gpu], driver_pid=10) == "broadcast"
    assert choose_path("auto", HOST, [other_pid, other_host], driver_pid=10) == "broadcast"
    # /dev/shm too small for a bucket (Docker's 64 MiB default): auto broadcasts instead
    small = {**HOST, "shm_free": 2**26}
    assert choose_path("auto", small, [other_pid], driver_pid=10, shm_needed=2**28) == "broadcast"
    assert choose_path("shared_memory", HOST, [HOST], driver_pid=10) == "shared_memory"
    assert choose_path("broadcast", HOST, [HOST], driver_pid=10) == "broadcast"
    assert choose_path("driver", HOST, [other_host], driver_pid=10) == "driver"
    with pytest.raises(RollError, match=r"receiver\(s\) \[1\] run on another host"):
        choose_path("shared_memory", HOST, [other_pid, other_host], driver_pid=10)


def test_recipe_keys_validate_and_the_plan_names_the_path() -> None:
    from roll_core.config import load_recipe
    from roll_core.engine.resource_plan import gpu_plan
    from roll_core.engine.weight_sync import planned_path

    def _path(cfg: Any) -> tuple[str, str]:
        return planned_path(cfg, gpu_plan(cfg))

    from roll_core.errors import ConfigError

    recipe = "recipes/tiny-arith-rlvr.yaml"
    assert _path(load_recipe(recipe, []))[0] == "same_process"
    assert _path(load_recipe(recipe, ["sync.path=driver"]))[0] == "driver"
    cfg = load_recipe(recipe, ["actor_infer.world_size=2", "actor_train.backend=fsdp2"])
    assert _path(cfg)[0] == "shared_memory"
    assert _path(load_recipe(recipe, ["sync.path=broadcast"]))[0] == "broadcast (gloo)"
    with pytest.raises(ConfigError, match="sync.bucket_mb"):
        load_recipe(recipe, ["sync.bucket_mb=0"])
    with pytest.raises(ConfigError, match="sync.path"):
        load_recipe(recipe, ["sync.path=carrier_pigeon"])
    two_nodes = [
        "executor.type=ray",
        "executor.num_gpus=16",
        "executor.gpus_per_node=8",
        "actor_train.device_mapping=[8,9,10,11,12,13,14,15]",  # node 1; actor_infer: node 0
        "actor_infer.world_size=8",
        "actor_train.world_size=8",
        "actor_train.backend=fsdp2",
        "actor_train.device=cuda",
        "actor_infer.device=cuda",
    ]
    assert _path(load_recipe(recipe, two_nodes))[0] == "broadcast (nccl)"
    one_gpu = ["actor_train.device=cuda", "actor_infer.device=cuda", "executor.num_gpus=1"]
    assert _path(load_recipe(recipe, one_gpu))[0] == "same_process"  # local: one process
    ray_one_gpu = [*one_gpu, "executor.type=ray"]  # colocated on one GPU, two processes
    assert _path(load_recipe(recipe, ray_one_gpu))[0] == "shared_memory (cuda_ipc)"
    error = r"shared_memory.*node 1 and actor_infer ranks on node\(s\) \[0\]"
    with pytest.raises(ConfigError, match=error):
        _path(load_recipe(recipe, [*two_nodes, "sync.path=shared_memory"]))


# ---- the real thing: trainer and inference ranks, gloo on CPU ------------------------------


def train_kwargs(**extra: object) -> dict:
    return dict(
        model_path=resolve_model_path("builtin:tiny-qwen3"),
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
        total_steps=10,
        micro_batch_size=4,
        seed=0,
        num_threads=1,
        device="cpu",
        precision="fp32",
        **extra,
    )


def infer_cluster(ex: LocalExecutor, world_size: int = 1, cls: type = ActorInfer) -> Cluster:
    c = Cluster(
        "actor_infer",
        cls,
        ex,
        world_size=world_size,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": dict(
                model_path=resolve_model_path("builtin:tiny-qwen3"), device="cpu", num_threads=1
            ),
        },
    )
    c.run("setup")
    return c


def train_cluster(ex: LocalExecutor, backend: str, world_size: int = 1, **extra: object) -> Cluster:
    c = Cluster(
        "actor_train",
        ActorTrain,
        ex,
        world_size=world_size,
        worker_kwargs={"spec": TrainBackendSpec(backend=backend, **train_kwargs(**extra))},
    )
    c.run("setup")
    return c


def one_step(train: Cluster) -> None:
    """An SFT step with a large LR: the trainer's weights move away from the initial ones."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    batch = Batch(
        tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": mask},
        meta={"loss_tokens": int(mask[:, 1:].sum())},
    )
    train.run_dp("train_step", batch)


def infer_weights(infer: Cluster, rank: int = 0) -> dict[str, torch.Tensor]:
    model = infer.handles[rank].worker.backend.model  # in this process (local executor)
    return dict(model.named_parameters())


def assert_bitwise(infer: Cluster, expected: dict[str, torch.Tensor]) -> None:
    for r in range(infer.world_size):
        got = infer_weights(infer, r)
        assert set(expected) <= set(got) or set(got) <= set(expected)
        changed = 0
        for name, value in got.items():
            ref = expected[name] if name in expected else expected["model.embed_tokens.weight"]
            assert value.dtype == ref.dtype and torch.equal(value, ref), name
            changed += 1
        assert changed == len(got)


def test_same_process_share_keeps_one_model() -> None:
    """`sync.share` (synchronous rollout, no offload): after a sync the hf engine's parameters
    are the trainer's own storage (one model in memory), the next update is the engine's
    weights without a copy, generation equals the copying sync's bit for bit, and a
    parameter the trainer replaced (a checkpoint load) is shared again at the next sync."""
    from roll_core.backends.infer import Request, SamplingParams

    ex = LocalExecutor()
    try:
        train = train_cluster(ex, "torch")
        shared, copied = infer_cluster(ex, world_size=1), infer_cluster(ex, world_size=1)
        one_step(train)
        ws = attach_weight_sync(train, shared, SyncSettings(share=True))
        ws.sync(version=1)
        attach_weight_sync(train, copied, SyncSettings()).sync(version=1)
        trainer = train.handles[0].worker.backend.model
        own = {n: p.data_ptr() for n, p in trainer.named_parameters()}
        engine = infer_weights(shared)
        assert all(engine[n].data_ptr() == ptr for n, ptr in own.items())
        head = shared.handles[0].worker.backend.model.lm_head.weight  # tied: the embedding
        assert head.data_ptr() in own.values()
        assert all(infer_weights(copied)[n].data_ptr() != ptr for n, ptr in own.items())
        one_step(train)  # the update is the engine's weights at once
        assert_bitwise(shared, train.named_weights())
        ws.sync(version=2)
        attach_weight_sync(train, copied, SyncSettings()).sync(version=2)
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        reqs = [Request(i, [5, 6, 7, 8 + i], seed=i) for i in range(3)]
        a, b = (c.handles[0].worker.backend.generate(reqs, params) for c in (shared, copied))
        assert [(c.response_ids, c.log_probs) for c in a] == [
            (c.response_ids, c.log_probs) for c in b
        ]
        name = "model.layers.0.mlp.up_proj.weight"  # the trainer replaces one parameter
        module = trainer.get_submodule(name.rsplit(".", 1)[0])
        module.weight = torch.nn.Parameter(module.weight.detach().clone())
        assert infer_weights(shared)[name].data_ptr() != module.weight.data_ptr()
        ws.sync(version=3)
        assert infer_weights(shared)[name].data_ptr() == module.weight.data_ptr()
    finally:
        ex.shutdown()


@pytest.mark.parametrize(
    ("path", "lora", "bucket_mb", "expect"),
    [
        ("auto", False, 256, "same_process"),
        ("broadcast", False, 0.001, "broadcast"),  # 1 KiB: every tensor is larger than a bucket
        ("shared_memory", True, 0.05, "shared_memory"),  # LoRA: packed into /dev/shm buckets
        ("shared_memory", False, 0.05, "shared_memory"),  # read from the trainer's own memory
        ("auto", True, 256, "same_process"),
    ],
)
def test_torch_to_hf_is_bitwise(path: str, lora: bool, bucket_mb: float, expect: str) -> None:
    ex = LocalExecutor()
    try:
        extra = {"lora": LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])}
        train = train_cluster(ex, "torch", **(extra if lora else {}))
        infer = infer_cluster(ex, world_size=2)
        one_step(train)
        if lora:  # B starts at 0: one step moves it, so merged weights differ from the base
            one_step(train)
        expected = train.named_weights()  # the driver path's copies: the reference
        before = infer_weights(infer)["model.layers.0.self_attn.q_proj.weight"].clone()
        assert not torch.equal(before, expected["model.layers.0.self_attn.q_proj.weight"])
        ws = attach_weight_sync(train, infer, SyncSettings(path=path, bucket_mb=bucket_mb))
        metrics = ws.sync(version=3)
        assert ws.path == expect
        assert_bitwise(infer, expected)
        assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in expected.values())
        assert metrics["sync/tensors"] == len(expected)
        if bucket_mb < 0.01:  # every tensor larger than a bucket went alone
            big = sum(t.numel() * 4 > bucket_mb * 2**20 for t in expected.values())
            assert big > len(expected) // 2 and metrics["sync/buckets"] >= big
        elif expect != "same_process":
            assert 1 < metrics["sync/buckets"] < len(expected)
        assert {h.worker.backend.version for h in infer.handles} == {3}
        if expect == "shared_memory":  # the parameters live in shared memory unless merged
            assert (train.handles[0].worker._sync_group.arena is None) == lora
        # a second sync reuses the group
        one_step(train)
        ws.sync(version=4)
        assert_bitwise(infer, train.named_weights())
    finally:
        ex.shutdown()


class _Counted:
    """Wraps a ProcessHandle: counts the bytes of every result the driver receives.

    The count runs in a done-callback, which the thread that completes the future runs after
    waking the waiters, so a caller may go on before it ran: `received` waits for every
    callback first."""

    def __init__(self, handle: object) -> None:
        self.handle = handle
        self._received = 0
        self._pending = 0
        self._idle = threading.Condition()

    def submit(self, method: str, *args: object, **kwargs: object):
        import cloudpickle

        with self._idle:
            self._pending += 1
        fut = self.handle.submit(method, *args, **kwargs)

        def count(f) -> None:
            size = len(cloudpickle.dumps(f.result())) if f.exception() is None else 0
            with self._idle:
                self._received += size
                self._pending -= 1
                self._idle.notify_all()

        fut.add_done_callback(count)
        return fut

    submit_async = submit

    @property
    def received(self) -> int:
        with self._idle:
            assert self._idle.wait_for(lambda: self._pending == 0, timeout=60)
            return self._received


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "path", "extra"),
    [
        ("fsdp2", "auto", {}),
        ("deepspeed", "broadcast", {"deepspeed": None}),
    ],
)
def test_sharded_trainers_sync_bitwise_without_the_driver(
    backend: str, path: str, extra: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roll_core.config.schema import DeepSpeedConfig

    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        extra = {"deepspeed": DeepSpeedConfig(zero_stage=3)}
    ex = LocalExecutor()
    try:
        train = train_cluster(ex, backend, world_size=2, **extra)
        infer = infer_cluster(ex)
        one_step(train)
        train.handles = [_Counted(h) for h in train.handles]
        ws = attach_weight_sync(train, infer, SyncSettings(path=path, bucket_mb=0.2))
        ws.connect()
        before = sum(h.received for h in train.handles)
        metrics = ws.sync(version=1)
        to_driver = sum(h.received for h in train.handles) - before
        assert ws.path == ("shared_memory" if path == "auto" else path)
        assert metrics["sync/buckets"] > 1
        # the results the driver got back from the sync calls: counts only, no tensor
        smallest = 64 * 4  # the model's smallest parameter (a norm of hidden 64) in bytes
        assert to_driver < metrics["sync/bytes"] / 100 and to_driver < 4 * smallest, to_driver
        expected = train.named_weights()
        assert_bitwise(infer, expected)
        # the instrument can fail: the driver path brings every weight to the driver
        before = sum(h.received for h in train.handles)
        WeightSync(train, infer, SyncSettings(path="driver")).sync(version=2)
        assert sum(h.received for h in train.handles) - before > metrics["sync/bytes"]
    finally:
        ex.shutdown()


class DyingInfer(ActorInfer):
    """An inference rank in its own process that dies after loading its first bucket."""

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict) -> bool:
        return True  # run in a subprocess under the local executor

    def _load_bucket(self, items: list) -> None:
        super()._load_bucket(items)
        os._exit(1)


@pytest.mark.slow
def test_receiver_killed_mid_transfer_fails_the_sync_naming_it() -> None:
    ex = LocalExecutor()
    try:
        train = train_cluster(ex, "torch")
        infer = infer_cluster(ex, cls=DyingInfer)
        ws = attach_weight_sync(
            train, infer, SyncSettings(path="broadcast", bucket_mb=0.05, timeout_s=20)
        )
        start = time.perf_counter()
        with pytest.raises(WorkerDiedError, match="actor_infer rank 0") as err:
            ws.sync(version=1)
        assert time.perf_counter() - start < 20
        print(err.value)
    finally:
        ex.shutdown()
