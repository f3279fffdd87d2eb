"""Packed, token-budget micro-batches with the output layer in chunks on 2 ranks (FSDP2,
DeepSpeed ZeRO-3; gloo, CPU) against the padded 1-process torch backend (whole logits), fp32,
one launch per backend with several checks:

* log-probs of the global batch (before and after training) within 1e-5;
* one SFT step then one RL step per loss-aggregation mode: every step's loss terms and
  gradient norm within 1e-5 (relative);
* the gradients themselves, through the weights: AdamW with ``eps = 1`` makes the first
  updates ``lr * m / (sqrt(v) + 1)``, at most as far apart as the gradients (times lr), so
  weight changes within ``1e-5 * lr`` mean gradients within about 1e-5.

The driver's token-balanced split gives the ranks unequal rows, and the 24-token budget
unequal micro-batch counts (brought into lock step by splitting or a dummy micro-batch).
"""

from __future__ import annotations

import pytest
import torch

from roll_core.algorithms.aggregation import LOSS_AGG_MODES
from roll_core.backends.train import TorchTrainBackend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.schema import DeepSpeedConfig, OptimConfig
from roll_core.data import Batch
from roll_core.engine import Cluster, LocalExecutor
from roll_core.models import resolve_model_path
from roll_core.workers.actor_train import ActorTrain
from roll_core.workers.objectives import get_objective

LR = 0.1
LENGTHS = [13, 5, 9, 2, 11, 7, 4]


def global_batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    b, width = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(3, 250, (b, width), generator=g)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(b, width - 1)
    for i, n in enumerate(LENGTHS):
        attn[i, :n] = 1
        resp[i, 2 : n - 1] = 1.0
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": resp,
            "advantages": torch.randn(b, width - 1, generator=g) * resp,
            "behaviour_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "old_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "loss_mask": torch.cat([torch.zeros(b, 1), resp], 1).long(),
        },
        meta={
            "response_tokens": float(resp.sum()),
            "sequences": float((resp.sum(1) > 0).sum()),
            "max_response_length": 16,
            "loss_tokens": float(resp.sum()),
        },
    )


def spec(**extra: object) -> TrainBackendSpec:
    return TrainBackendSpec(
        model_path=resolve_model_path("builtin:tiny-qwen3"),
        optim=OptimConfig(lr=LR, eps=1.0, max_grad_norm=None, scheduler="constant"),
        total_steps=10,
        micro_batch_size=2,
        seed=0,
        num_threads=1,
        device="cpu",
        precision="fp32",
        **extra,  # type: ignore[arg-type]
    )


STEPS = [("sft", {})] + [
    ("rl", {"algorithm": AlgorithmConfig(loss_agg_mode=mode), "temperature": 1.0})
    for mode in LOSS_AGG_MODES
]
LOSS_KEYS = ("train/loss_sum", "actor/pg_loss")


def reduce(outs: list[dict[str, float]]) -> dict[str, float]:
    """Loss terms summed over ranks; the grad norm (the same on every rank) as it is."""
    out = {k: sum(o[k] for o in outs) for k in LOSS_KEYS if k in outs[0]}
    return out | {"train/grad_norm": outs[0]["train/grad_norm"]}


@pytest.fixture(scope="module")
def padded() -> dict:
    """The padded 1-process run: log-probs before/after, per-step metrics, weights."""
    threads = torch.get_num_threads()
    backend = TorchTrainBackend(spec(packing=False))
    torch.set_num_threads(threads)
    out: dict = {"log_probs": [backend.log_probs(global_batch())], "steps": []}
    start = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    for name, params in STEPS:
        out["steps"].append(
            reduce([backend.train_step(global_batch(), get_objective(name, **params))])
        )
        if name == "sft":
            out["first_update"] = {
                n: (p.detach() - start[n]) / LR for n, p in backend.model.named_parameters()
            }
    out["log_probs"].append(backend.log_probs(global_batch()))
    out["start"] = start
    return out


def run_sharded(backend: str, **extra: object) -> dict:
    ex = LocalExecutor()
    try:
        c = Cluster(
            "actor_train",
            ActorTrain,
            ex,
            world_size=2,
            # and the output layer 4 positions at a time (backends/train/lm_head.py): FSDP2's
            # root, kept gathered, runs it after the forward and again in the backward; ZeRO-3
            # computes its logits whole (its partitioned head would gather once per chunk)
            worker_kwargs={
                "spec": spec(
                    backend=backend, max_tokens_per_micro_batch=24, logit_chunk_tokens=4, **extra
                )
            },
        )
        c.run("setup")
        out: dict = {"log_probs": [torch.cat(c.run_dp("log_probs", global_batch()))], "steps": []}
        for name, params in STEPS:
            out["steps"].append(
                reduce(c.run_dp("train_step", global_batch(), objective=name, **params))
            )
            if name == "sft":
                out["weights_after_first"] = c.run_rank0("named_weights")
        out["log_probs"].append(torch.cat(c.run_dp("log_probs", global_batch())))
        return out
    finally:
        ex.shutdown()


def check(sharded: dict, padded: dict) -> None:
    for got, want in zip(sharded["log_probs"], padded["log_probs"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for k, (got, want) in enumerate(zip(sharded["steps"], padded["steps"], strict=True)):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (STEPS[k][0], key)
    for name, value in sharded["weights_after_first"].items():
        update = (value - padded["start"][name]) / LR
        torch.testing.assert_close(
            update, padded["first_update"][name], rtol=0, atol=1e-5, msg=name
        )


@pytest.mark.slow
def test_fsdp2_two_ranks_packed_equal_padded(padded: dict) -> None:
    check(run_sharded("fsdp2"), padded)


@pytest.mark.slow
def test_deepspeed_zero3_two_ranks_packed_equal_padded(padded: dict) -> None:
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    check(run_sharded("deepspeed", deepspeed=DeepSpeedConfig(zero_stage=3)), padded)
