"""Weight sync actor_train -> actor_infer: seconds per sync, old driver path vs the data plane.

For each model (the built-in tiny model, and a random-init Qwen3-shaped model of ~0.5B
parameters: hidden 896, 24 layers, vocab 151936, bf16, built on CPU with transformers'
Qwen3Config), with the real ActorTrain (torch backend) and ActorInfer (hf backend) workers:

* ``raw``: ``copy_`` of the same bytes, parameter by parameter, in one process (the floor);
* in one process (executor local, what ``auto`` gives a single-process run): the old
  ``driver`` path vs ``same_process`` (in-place copies);
* trainer and inference rank each in its own process (as under Ray or with fsdp2 ranks): the
  old ``driver`` path vs ``shared_memory`` and ``broadcast`` (gloo over loopback).

Prints the median of `--repeats` syncs of each and the ratios new/raw (target <= 1.5) and
new/old (old = the driver path in the same setting). Not a test: numbers depend on the
machine; report them with its load (`uptime`).

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 nice python benchmarks/weight_sync.py \
        [--models tiny,qwen3-0.5b] [--repeats 3] [--bucket-mb 256]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.config.schema import OptimConfig
from roll_core.engine import Cluster, LocalExecutor
from roll_core.engine.weight_sync import SyncSettings, WeightSync
from roll_core.models import resolve_model_path
from roll_core.workers.actor_infer import ActorInfer
from roll_core.workers.actor_train import ActorTrain


class ProcTrain(ActorTrain):
    """ActorTrain in its own process under the local executor (as a Ray actor would be)."""

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        return True


class ProcInfer(ActorInfer):
    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        return True


def qwen3_half_b(root: Path, tokenizer: str) -> tuple[str, str]:
    """A random-init Qwen3-shaped model of ~0.5B parameters saved under `root` (bf16)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = root / "qwen3-0.5b"
    if not (path / "config.json").exists():
        cfg = Qwen3Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=151936,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
    return str(path), "bfloat16"


def clusters(model: str, dtype: str, *, separate: bool) -> tuple[LocalExecutor, Cluster, Cluster]:
    ex = LocalExecutor()
    tok = resolve_model_path("builtin:tiny-qwen3")
    train = Cluster(
        "actor_train",
        ProcTrain if separate else ActorTrain,
        ex,
        worker_kwargs={
            "spec": TrainBackendSpec(
                model_path=model,
                tokenizer_path=tok,
                dtype=dtype,
                device="cpu",
                precision="fp32",
                optim=OptimConfig(),
                total_steps=1,
                micro_batch_size=1,
                num_threads=1,
            ),
        },
    )
    infer = Cluster(
        "actor_infer",
        ProcInfer if separate else ActorInfer,
        ex,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": dict(
                model_path=model,
                tokenizer_path=tok,
                device="cpu",
                num_threads=1,
                dtype=getattr(torch, dtype),
            ),
        },
    )
    train.run("setup")
    infer.run("setup")
    return ex, train, infer


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up: joins the group, maps the buffers, faults the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_copy(model: str, dtype: str, repeats: int) -> tuple[float, int, int]:
    from roll_core.models import load_causal_lm

    src = load_causal_lm(model, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    params = [p.detach() for p in src.parameters()]
    dst = [p.clone() for p in params]

    def copy() -> None:
        for d, s in zip(dst, params, strict=True):
            d.copy_(s)

    size = sum(p.numel() * p.element_size() for p in params)
    return timed(copy, repeats), size, sum(p.numel() for p in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,qwen3-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="roll-bench-sync-"))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load}; 1 thread per process; median of {args.repeats}", flush=True)
    header = f"{'model':<11} {'params':>8} {'MiB':>7} {'setting':<13} {'path':<14} {'ms/sync':>9}"
    print(header + f" {'new/raw':>8} {'new/old':>8}")
    versions = itertools.count(1)
    for name in args.models.split(","):
        if name == "tiny":
            model, dtype = resolve_model_path("builtin:tiny-qwen3"), "float32"
        else:
            model, dtype = qwen3_half_b(root, resolve_model_path("builtin:tiny-qwen3"))
        raw, size, numel = raw_copy(model, dtype, args.repeats)
        what = f"{name:<11} {numel / 1e6:7.1f}M {size / 2**20:7.1f}"
        row(what, "one process", "raw copy_", raw, raw, None)
        for separate, paths in ((False, ["same_process"]), (True, ["shared_memory", "broadcast"])):
            setting = "two processes" if separate else "one process"
            ex, train, infer = clusters(model, dtype, separate=separate)
            try:
                old_sync = WeightSync(train, infer, SyncSettings(path="driver"))
                old = timed(lambda s=old_sync: s.sync(next(versions)), args.repeats)
                row(what, setting, "driver (old)", old, raw, old)
                for path in paths:
                    requested = "auto" if path == "same_process" else path
                    ws = WeightSync(
                        train, infer, SyncSettings(path=requested, bucket_mb=args.bucket_mb)
                    )
                    new = timed(lambda s=ws: s.sync(next(versions)), args.repeats)
                    assert ws.path == path, (ws.path, path)
                    row(what, setting, path, new, raw, old)
            finally:
                ex.shutdown()


def row(what: str, setting: str, path: str, seconds: float, raw: float, old: float | None) -> None:
    ratio_old = f"{seconds / old:8.2f}" if old else f"{'-':>8}"
    print(
        f"{what} {setting:<13} {path:<14} {seconds * 1e3:9.2f} {seconds / raw:8.2f} {ratio_old}",
        flush=True,
    )


if __name__ == "__main__":
    main()
