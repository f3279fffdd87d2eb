"""CPU cost of one RL update on the tiny model, with and without the old-log-prob pass.

A synthetic GRPO batch (128 rows: 30 prompt + up to 6 response tokens) through the torch train
backend's real `log_probs` and `train_step` with the `rl` objective. Prints the median over 5
repeats of process CPU time (steadier than wall time on a shared machine) of the old-log-prob
forward and of the update; `--skip` leaves the pass out (what `trainer.old_log_probs: auto`
does for one-update steps); `--profile` adds a torch.profiler table of the update.

    OMP_NUM_THREADS=1 python benchmarks/rl_update.py [--micro 32] [--skip] [--profile]
        [--precision fp32|bf16] [--ckpt]

Run it on two checkouts (PYTHONPATH=...) to compare code versions (docs/performance.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.schema import OptimConfig
from roll_core.data import Batch
from roll_core.models import resolve_model_path
from roll_core.workers.objectives import get_objective

ROWS, PROMPT, RESPONSE = 128, 30, 6


def make_batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    width = PROMPT + RESPONSE
    ids = torch.randint(0, 256, (ROWS, width), generator=gen)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=gen)
    attn = torch.zeros(ROWS, width, dtype=torch.long)
    resp = torch.zeros(ROWS, width - 1)
    for i in range(ROWS):
        attn[i, : PROMPT + lengths[i]] = 1
        resp[i, PROMPT - 1 : PROMPT - 1 + lengths[i]] = 1
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": resp,
        "behaviour_log_probs": -torch.rand(ROWS, width - 1, generator=gen) * resp,
        "advantages": torch.randn(ROWS, width - 1, generator=gen) * resp,
    }
    meta = {
        "response_tokens": float(resp.sum()),
        "sequences": float(ROWS),
        "max_response_length": float(RESPONSE),
    }
    return Batch(tensors=tensors, non_tensors={}, meta=meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--skip", action="store_true", help="no old-log-prob pass")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    a = ap.parse_args()
    backend = TorchTrainBackend(
        TrainBackendSpec(
            model_path=resolve_model_path("builtin:tiny-qwen3"),
            optim=OptimConfig(lr=1e-5),
            total_steps=100,
            micro_batch_size=a.micro,
            precision=a.precision,
            gradient_checkpointing=a.ckpt,
        )
    )
    batch = make_batch()
    algo = AlgorithmConfig(preset="grpo", kl={"coef": 0.0})
    objective = get_objective("rl", algorithm=algo, temperature=1.0)

    def step() -> tuple[float, float]:
        t0 = time.process_time()
        if not a.skip:
            batch.tensors["old_log_probs"] = backend.log_probs(batch)
        t1 = time.process_time()
        backend.train_step(batch, objective)
        return t1 - t0, time.process_time() - t1

    for _ in range(2):
        step()
    runs = [step() for _ in range(5)]
    old = sorted(r[0] for r in runs)[2] * 1e3
    update = sorted(r[1] for r in runs)[2] * 1e3
    print(
        f"{a.precision} ckpt={a.ckpt} micro {a.micro}: old-log-prob {old:.1f} ms, update {update:.1f} ms (CPU)"
    )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            backend.train_step(batch, objective)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
