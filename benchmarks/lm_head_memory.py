"""Peak memory of one RL update with the chunked output layer against the whole-micro-batch
logits (`actor_train.logit_chunk_tokens` null against 0), in the same command.

Model: vs_trl's long setting shape (a random-init Qwen3: hidden 128, 2 layers, 4 heads / 2 KV
heads of 32, MLP 384, tied embeddings) with the real Qwen vocabulary width, 151,936 rows.
Each arm is its own process (peak RSS is per process: `ru_maxrss`), the torch backend, one
packed micro-batch of `--budget` real tokens (rows of 512: a 128-token prompt and a 384-token
response), the `rl` objective (GRPO's clipped loss, the entropy metric), bf16 autocast or
fp32. Printed per arm: the process's peak RSS, the growth over the RSS after the model is
built (the update's own memory: the optimizer's state and the gradients exist before, made by a
warm-up step on one row), the memory plan's estimate of the logits' share
(engine/placement.py:logits_memory) and the wall time of the step; then the ratios. With
`--limit MIB`, each arm also reports the largest budget (of `--budgets`) whose update grows
the process by at most MIB: the largest packed micro-batch that fits that memory.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/lm_head_memory.py --budget 4096 --precision bf16
    python benchmarks/lm_head_memory.py --limit 2048 --budgets 2048 4096 8192 16384 32768
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936
ROW, PROMPT = 512, 128


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def model_dir(root: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = root / "model"
    if not (path / "config.json").exists():
        import torch

        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        Qwen3ForCausalLM(config).save_pretrained(path)
        from roll_core.models import load_tokenizer, resolve_model_path

        load_tokenizer(resolve_model_path("builtin:tiny-qwen3")).save_pretrained(path)
    return path


def worker(spec: dict) -> dict:
    import torch

    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.backends.train.torch_backend import TorchTrainBackend
    from roll_core.config.algorithm import AlgorithmConfig
    from roll_core.config.schema import OptimConfig
    from roll_core.data import Batch
    from roll_core.engine.model_sizes import ModelShape
    from roll_core.engine.placement import LogitsSpec, logits_memory
    from roll_core.workers.objectives import get_objective

    torch.set_num_threads(spec["threads"])
    backend = TorchTrainBackend(
        TrainBackendSpec(
            model_path=spec["model"],
            device="cpu",
            precision=spec["precision"],
            optim=OptimConfig(lr=1e-5),
            micro_batch_size=1,
            max_tokens_per_micro_batch=spec["budget"],
            logit_chunk_tokens=spec["chunk"],
            num_threads=spec["threads"],
        )
    )
    rows = spec["budget"] // ROW
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150_000, (rows, ROW), generator=g)
    resp = torch.zeros(rows, ROW - 1)
    resp[:, PROMPT - 1 :] = 1.0
    batch = Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": resp,
            "advantages": torch.randn(rows, ROW - 1, generator=g) * resp,
            "behaviour_log_probs": -torch.rand(rows, ROW - 1, generator=g) * resp,
        },
        meta={
            "response_tokens": float(resp.sum()),
            "sequences": float(rows),
            "max_response_length": ROW - PROMPT,
        },
    )
    objective = get_objective("rl", algorithm=AlgorithmConfig(kl={"coef": 0.0}))
    # first-call allocations (threads, kernels, AdamW's state, gradients) in the baseline
    warm = batch.select([0])
    backend.log_probs(warm)
    backend.train_step(warm, objective)
    base = rss_mib()
    start = time.perf_counter()
    backend.log_probs(batch)
    backend.train_step(batch, objective)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shape = ModelShape.from_config(backend.model.config.to_dict())
    plan = logits_memory(
        shape,
        LogitsSpec(
            micro_batch_size=rows,
            seq_len=ROW,
            response_len=ROW - PROMPT,
            logits_bytes=2 if spec["precision"] == "bf16" else 4,
            max_tokens=spec["budget"],
            chunk_tokens=spec["chunk"],
        ),
    )
    return {
        "peak_mib": peak,
        "growth_mib": peak - base,
        "plan_logits_mib": plan / 2**20,
        "step_s": seconds,
    }


def run_arm(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"arm {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=4096, help="real tokens per micro-batch")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", nargs="+", default=["0", "auto"], help="0, auto or a number")
    ap.add_argument("--limit", type=float, help="MiB an update may add (largest budget)")
    ap.add_argument("--budgets", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    root = Path(os.environ.get("ROLL_BENCH_CACHE", ".cache")) / "bench-lm-head"
    root.mkdir(parents=True, exist_ok=True)
    model = str(model_dir(root))
    load = os.getloadavg()[0]
    print(f"cpu: {os.cpu_count()} cores, load {load:.1f}; vocab {VOCAB}, rows of {ROW} tokens")
    chunks = [None if c == "auto" else int(c) for c in a.chunks]
    budgets = a.budgets if a.limit else [a.budget]
    results: dict[tuple, dict] = {}
    over: set = set()  # arms past the limit at a smaller budget: not run larger (memory)
    for budget in budgets:
        for chunk in chunks:
            if chunk in over:
                continue
            spec = {"model": model, "precision": a.precision, "threads": a.threads}
            spec |= {"budget": budget, "chunk": chunk}
            r = results[(budget, chunk)] = run_arm(spec)
            name = "auto" if chunk is None else str(chunk)
            print(
                f"budget {budget:6d} chunk {name:>5}: peak {r['peak_mib']:8.0f} MiB, update "
                f"+{r['growth_mib']:7.0f} MiB (plan, logits: {r['plan_logits_mib']:7.0f}), "
                f"step {r['step_s']:6.1f} s",
                flush=True,
            )
            if a.limit and r["growth_mib"] > a.limit:
                over.add(chunk)
        if len(chunks) == 2 and all((budget, c) in results for c in chunks):
            first, second = (results[(budget, c)] for c in chunks)
            print(
                f"  ratio {a.chunks[1]} / {a.chunks[0]}: update memory "
                f"{second['growth_mib'] / first['growth_mib']:.3f}, step time "
                f"{second['step_s'] / first['step_s']:.3f}"
            )
    if a.limit:
        for chunk in chunks:
            fit = [
                b
                for b in budgets
                if (b, chunk) in results and results[(b, chunk)]["growth_mib"] <= a.limit
            ]
            name = "auto" if chunk is None else str(chunk)
            print(f"largest budget within +{a.limit:.0f} MiB, chunk {name}: {max(fit, default=0)}")


if __name__ == "__main__":
    main()
