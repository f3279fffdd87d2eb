"""Offload -> reload of a train rank's state (roll_core/backends/train/offload.py) is exact.

Each backend trains one step, offloads optimizer state, gradients and parameters (their
storages really freed: 0 bytes held), reloads, trains a second step, and must end with the
same parameter digest, bit for bit, as the same two steps without the round trip. On CPU the
backup is another CPU buffer, so the mechanism (backup, resize to 0, resize back, copy in)
runs exactly as on a GPU, minus pinned memory.
"""

from __future__ import annotations

import pytest
import torch

from roll_core.backends.offload import StorageStash, device_memory
from roll_core.backends.train import TorchTrainBackend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.offload import TRAIN_PARTS, TrainOffloader
from roll_core.config.schema import DeepSpeedConfig, OptimConfig
from roll_core.data import Batch
from roll_core.engine import Cluster, LocalExecutor
from roll_core.models import resolve_model_path
from roll_core.workers.actor_train import ActorTrain
from roll_core.workers.objectives import get_objective


def batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0
    return Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
        meta={"loss_tokens": int(loss_mask[:, 1:].sum())},
    )


def kwargs() -> dict:
    return dict(
        model_path=resolve_model_path("builtin:tiny-qwen3"),
        optim=OptimConfig(lr=1e-3, eps=1e-6, scheduler="constant"),
        total_steps=10,
        micro_batch_size=2,
        seed=0,
        num_threads=1,
        device="cpu",
        precision="fp32",
    )


def test_stash_frees_storage_and_restores_views_bitwise() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    a, b = flat[:4], flat[4:].view(2, 4)  # views of one storage, as in a ZeRO flat buffer
    before = flat.clone()
    stash = StorageStash()
    assert stash.offload([a, b, flat]) == 12 * 4  # one storage, counted once
    assert flat.untyped_storage().nbytes() == 0 and a.untyped_storage().nbytes() == 0
    assert stash.reload() == 48
    assert torch.equal(flat, before) and torch.equal(b, before[4:].view(2, 4))
    b.add_(1)  # still views of the one storage
    assert flat[4] == before[4] + 1


def test_stash_rehomes_memory_mapped_storage(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(tmp_path / "w.safetensors"))
    w = load_file(str(tmp_path / "w.safetensors"))["w"]
    stash = StorageStash()
    assert stash.offload([w]) == 24
    assert w.untyped_storage().nbytes() == 0
    stash.reload()
    assert torch.equal(w, torch.arange(6, dtype=torch.float32))


def test_stash_leaves_shared_memory_alone() -> None:
    shared = torch.arange(4, dtype=torch.float32).share_memory_()  # e.g. mapped by a receiver
    private = torch.ones(2)
    stash = StorageStash()
    assert stash.offload([shared, private]) == 8
    assert shared.untyped_storage().nbytes() == 16 and shared.is_shared()
    stash.reload()
    assert torch.equal(private, torch.ones(2))


def test_device_memory_reports_rss_on_cpu() -> None:
    mem = device_memory("cpu")
    assert set(mem) == {"rss_gb"} and 0 < mem["rss_gb"] < 1024


def test_torch_backend_round_trip_is_bitwise() -> None:
    objective = get_objective("sft")
    plain = TorchTrainBackend(TrainBackendSpec(**kwargs()))
    for _ in range(2):
        plain.train_step(batch(), objective)
    expected = plain.state_digest()

    backend = TorchTrainBackend(TrainBackendSpec(**kwargs()))
    backend.train_step(batch(), objective)
    assert backend.optimizer.state  # AdamW moments exist after a step
    step_before = {id(p): s["step"].clone() for p, s in backend.optimizer.state.items()}
    off = TrainOffloader(backend)
    moved = off.offload(list(TRAIN_PARTS))
    n_params = sum(p.numel() for p in backend.model.parameters())
    assert moved["optimizer"] == 2 * 4 * n_params  # exp_avg + exp_avg_sq, float32
    assert moved["grads"] == 4 * n_params  # released, not copied
    assert moved["params"] >= 4 * n_params  # + buffers (rotary inv_freq)
    assert all(off.held_bytes(part) == 0 for part in TRAIN_PARTS)
    assert all(p.grad is None for p in backend.model.parameters())
    for p, s in backend.optimizer.state.items():  # `step` is not moved
        assert torch.equal(s["step"], step_before[id(p)])
    assert off.reload() == {"optimizer": moved["optimizer"], "params": moved["params"]}
    assert off.offloaded == []
    backend.train_step(batch(), objective)
    assert backend.state_digest() == expected


@pytest.mark.slow
@pytest.mark.parametrize("stage", [None, 2, 3], ids=["fsdp2", "zero2", "zero3"])
def test_sharded_round_trip_is_bitwise(stage: int | None, tmp_path) -> None:
    """fsdp2 (DTensor shards) and DeepSpeed ZeRO-2 / ZeRO-3 on 2 ranks (gloo). One cluster:
    step 1, checkpoint, step 2 -> digest; back to the checkpoint (exact resume, tested in
    test_fsdp2.py / test_deepspeed.py), offload -> reload, step 2 again -> the same digest."""
    if stage is not None:
        pytest.importorskip("deepspeed")
    extra = {} if stage is None else {"deepspeed": DeepSpeedConfig(zero_stage=stage)}
    ex = LocalExecutor()
    try:
        c = Cluster(
            "actor_train",
            ActorTrain,
            ex,
            world_size=2,
            worker_kwargs={
                "spec": TrainBackendSpec(
                    backend="fsdp2" if stage is None else "deepspeed", **kwargs(), **extra
                ),
            },
        )
        c.run("setup")
        c.run_dp("train_step", batch())
        c.run("save", str(tmp_path / "ckpt"))
        c.run_dp("train_step", batch())
        expected = c.run_rank0("state_digest")

        c.run("load", str(tmp_path / "ckpt"))
        reports = c.offload(list(TRAIN_PARTS))
        assert len(reports) == 2
        for r in reports:  # every rank freed every part
            assert r["bytes/optimizer"] > 0 and r["bytes/params"] > 0
            assert r["held/optimizer"] == r["held/params"] == r["held/grads"] == 0
        back = c.reload()
        assert [b["bytes/params"] for b in back] == [r["bytes/params"] for r in reports]
        c.run_dp("train_step", batch())
        assert c.run_rank0("state_digest") == expected
    finally:
        ex.shutdown()
