"""Peak memory of one RL update with the real Qwen vocabulary: chunked LM head against full logits.

A random-init Qwen3-architecture model with Qwen's 151,936-token vocabulary (hidden 256, 2
layers, tied embeddings: the head is most of it, as in a small real model), through the torch
train backend's real `train_step` with the `rl` objective (GRPO preset), fp32 on CPU. One
packed micro-batch of `budget` tokens (rows of 512 tokens, 64 of them prompt: 7/8 of the
positions are response), `actor_train.logit_chunk_tokens` 0 (the whole micro-batch's logits)
or the chunk size given. Each (chunk, budget) runs in its own subprocess; the peak resident
memory above the loaded model is its own. Prints the table and, for `--limit` MiB, the
largest budget that stays under it in each arm (issue 44: "a packed micro-batch that did
not fit before now fits").

    OMP_NUM_THREADS=1 python benchmarks/lm_head_memory.py \
        [--chunks 0,512] [--budgets 512,1024,2048,4096,8192] [--limit 3072]

An arm stops at the first budget whose peak exceeds twice the limit (the machine's memory
is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 151_936
ROW = 512
PROMPT = 64


def make_batch(budget: int) -> object:
    """`budget // ROW` rows of ROW tokens, PROMPT of them prompt, random advantages."""
    from roll_core.data import Batch

    rows = max(1, budget // ROW)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (rows, ROW), generator=g)
    attn = torch.ones_like(ids)
    resp = torch.zeros(rows, ROW - 1)
    resp[:, PROMPT - 1 :] = 1.0
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
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


def build_model(root: Path) -> tuple[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from roll_core.models import resolve_model_path

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(root / "model")
    return str(root / "model"), resolve_model_path("builtin:tiny-qwen3")


def worker(args: argparse.Namespace) -> None:
    """One (chunk, budget), in this process: prints one JSON line."""
    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.backends.train.torch_backend import TorchTrainBackend
    from roll_core.config.algorithm import AlgorithmConfig
    from roll_core.config.schema import OptimConfig
    from roll_core.workers.objectives import get_objective

    backend = TorchTrainBackend(
        TrainBackendSpec(
            model_path=args.model,
            tokenizer_path=args.tokenizer,
            device="cpu",
            precision="fp32",
            optim=OptimConfig(lr=1e-5),
            total_steps=2,
            num_threads=1,
            packing=True,
            max_tokens_per_micro_batch=args.budget,
            logit_chunk_tokens=args.chunk,
        )
    )
    batch = make_batch(args.budget)
    objective = get_objective("rl", algorithm=AlgorithmConfig(preset="grpo"))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, after the model loaded
    cpu = time.process_time()
    metrics = backend.train_step(batch, objective)
    cpu = time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "chunk": args.chunk,
                "budget": args.budget,
                "tokens": metrics["perf/tokens"],
                "cpu_s": cpu,
                "peak_mib_above_model": (peak - base) / 1024,
                "loss_terms": metrics["actor/pg_loss"],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="0,512")
    ap.add_argument("--budgets", default="512,1024,2048,4096,8192")
    ap.add_argument("--limit", type=float, default=3072.0, help="MiB above the model")
    ap.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chunk is not None:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_model(Path(tmp))
        fits: dict[int, int] = {}
        for chunk in map(int, args.chunks.split(",")):
            for budget in map(int, args.budgets.split(",")):
                cmd = [sys.executable, __file__, "--chunk", str(chunk), "--budget", str(budget)]
                cmd += ["--model", model, "--tokenizer", tok]
                out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if out.returncode != 0:
                    print(f"chunk {chunk} budget {budget}: failed\n{out.stderr[-2000:]}")
                    break
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(
                    f"logit_chunk_tokens {chunk:5d}  budget {budget:6d}  peak "
                    f"+{r['peak_mib_above_model']:7.0f} MiB  cpu {r['cpu_s']:6.1f} s  "
                    f"pg_loss {r['loss_terms']:.6f}",
                    flush=True,
                )
                if r["peak_mib_above_model"] <= args.limit:
                    fits[chunk] = budget
                if r["peak_mib_above_model"] > 2 * args.limit:
                    break
        for chunk in map(int, args.chunks.split(",")):
            print(
                f"logit_chunk_tokens {chunk}: largest budget under {args.limit:.0f} MiB: "
                f"{fits.get(chunk, 'none')}"
            )


if __name__ == "__main__":
    main()
