"""Resident memory of a trainer and an hf engine in one process (executor `local`, the
`same_process` weight sync) with the engine holding its own copy of the weights against the
engine reading the trainer's parameters (`SyncPlan.share`, issue 44 item 2), in one command.

Each arm is its own process: roll's torch train backend and hf inference engine on one
random-init Qwen3 (the real Qwen vocabulary, 151,936 rows, tied embeddings; `--hidden`,
`--layers`), one SFT step (the optimizer state exists), the weight sync as a run makes it
(`WeightSync` over local clusters, `SyncSettings.share` off / on), a generation of 8 x 32
tokens, then a second step and sync. Printed per arm: the RSS after the model is built (both
copies exist), after the syncs and the generation (the steady state of a run), the model's
parameter bytes; then the ratio of the steady states and the difference in model copies.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/one_model_memory.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def model_dir(root: Path, hidden: int, layers: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = root / f"model-{hidden}x{layers}"
    if not (path / "config.json").exists():
        import torch

        from roll_core.models import load_tokenizer, resolve_model_path

        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True,
        )  # fmt: skip
        Qwen3ForCausalLM(config).save_pretrained(path)
        load_tokenizer(resolve_model_path("builtin:tiny-qwen3")).save_pretrained(path)
    return path


def arm(model: str, share: bool) -> dict[str, float]:
    import torch

    from roll_core.backends.infer import Request, SamplingParams
    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.config.schema import OptimConfig
    from roll_core.data import Batch
    from roll_core.engine import Cluster, LocalExecutor
    from roll_core.engine.weight_sync import SyncSettings, attach_weight_sync
    from roll_core.workers.actor_infer import ActorInfer
    from roll_core.workers.actor_train import ActorTrain

    torch.set_num_threads(1)
    ex = LocalExecutor()
    spec = TrainBackendSpec(model_path=model, optim=OptimConfig(lr=1e-4), total_steps=4,
                            micro_batch_size=8, device="cpu", num_threads=1)  # fmt: skip
    train = Cluster("actor_train", ActorTrain, ex, worker_kwargs={"spec": spec})
    infer = Cluster("actor_infer", ActorInfer, ex, worker_kwargs={
        "backend": "hf", "backend_kwargs": {"model_path": model, "device": "cpu"}})  # fmt: skip
    train.setup()
    infer.setup()
    params = sum(
        p.numel() * p.element_size() for p in train.handles[0].worker.backend.model.parameters()
    )
    built = rss_mib()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (8, 64), generator=g)
    mask = torch.ones_like(ids)
    batch = Batch(tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": mask},
                  meta={"loss_tokens": int(mask[:, 1:].sum())})  # fmt: skip
    sync = attach_weight_sync(train, infer, SyncSettings(share=share))
    engine = infer.handles[0].worker.backend
    reqs = [Request(i, [5, 6, 7, 8 + i], seed=i) for i in range(8)]
    for version in (1, 2):
        train.run_dp("train_step", batch)
        sync.sync(version)
        engine.generate(reqs, SamplingParams(max_new_tokens=32, temperature=1.0))
    gc.collect()
    return {"share": share, "params_mib": params / 2**20, "built_mib": built,
            "steady_mib": rss_mib()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--root", default="/tmp/roll-one-model")
    ap.add_argument("--arm", choices=["copy", "share"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = str(model_dir(Path(args.root), args.hidden, args.layers))
    if args.arm:
        print(json.dumps(arm(model, args.arm == "share")))
        return
    results = {}
    for name in ("copy", "share"):
        out = subprocess.run(
            [sys.executable, __file__, "--arm", name, "--root", args.root,
             "--hidden", str(args.hidden), "--layers", str(args.layers)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name:5s}: model {r['params_mib']:.0f} MiB; RSS built {r['built_mib']:.0f} MiB, "
              f"steady {r['steady_mib']:.0f} MiB")  # fmt: skip
    saved = results["copy"]["steady_mib"] - results["share"]["steady_mib"]
    ratio = results["share"]["steady_mib"] / results["copy"]["steady_mib"]
    copies = saved / results["copy"]["params_mib"]
    print(
        f"share / copy steady RSS: {ratio:.2f}x ({saved:.0f} MiB less = {copies:.2f} model copies)"
    )
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
