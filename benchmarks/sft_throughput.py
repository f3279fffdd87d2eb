"""SFT training throughput: `roll sft` against a minimal hand-written PyTorch loop.

Both train the same model on the same data with the same batch size, optimizer and
threads, in this one command. The hand-written loop is the floor of overhead: forward,
masked cross-entropy, backward, clip, AdamW, LR step, nothing else. `roll sft` runs as a user
runs it (subprocess, real CLI, console + jsonl trackers, per-step meta update, checkpoints off)
and its rate comes from the timestamps in its metrics.jsonl, so every driver overhead counts.

    python benchmarks/sft_throughput.py [--model builtin:small-qwen3] [--steps 60]

Prints tokens/s of each and the ratio roll / hand-written (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "tiny-arith" / "train.jsonl"


def hand_written(
    model_path: str, batches: list[dict], *, steps: int, warmup: int, lr: float
) -> float:
    """Tokens/s of the bare loop over `batches` (steps after `warmup` are timed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tokens, start = 0, 0.0
    for i in range(warmup + steps):
        if i == warmup:
            tokens, start = 0, time.perf_counter()
        b = batches[i % len(batches)]
        ids, attn, mask = b["input_ids"], b["attention_mask"], b["loss_mask"]
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        per_tok = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)),
            ids[:, 1:].reshape(-1),
            reduction="none",
        )
        m = mask[:, 1:].float().reshape(-1)
        loss = (per_tok * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += int(attn.sum())
    return tokens / (time.perf_counter() - start)


def roll_sft(model: str, *, steps: int, warmup: int, batch: int, lr: float, threads: int) -> float:
    """Tokens/s of `roll sft` from its metrics.jsonl timestamps (steps after `warmup`)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            str(Path(sys.executable).parent / "roll"),
            "sft",
            str(ROOT / "recipes/tiny-arith-sft.yaml"),
            f"model.path={model}",
            f"runs_dir={tmp}",
            f"trainer.max_steps={warmup + steps}",
            f"trainer.micro_batch_size={batch}",
            "trainer.grad_accum_steps=1",
            "trainer.log_every_steps=1",
            f"actor_train.optim.lr={lr}",
            "actor_train.optim.warmup_steps=0",
            "actor_train.optim.scheduler=constant",
            f"actor_train.num_threads={threads}",
            "eval.every_steps=null",
            "eval.exact_match=false",
            "data.eval=null",
            "checkpoint.every_steps=null",
            "checkpoint.export_final=false",
            "tracking.backends=[console,jsonl]",
            "--run-id",
            "bench-run-00",
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        rows = [
            json.loads(x)
            for x in (Path(tmp) / "bench-run-00" / "metrics.jsonl").read_text().splitlines()
        ]
    timed = [r for r in rows if r["step"] > warmup]
    first = next(r for r in rows if r["step"] == warmup)
    tokens = sum(r["perf/tokens_per_s"] * r["perf/step_s"] for r in timed)
    return tokens / (timed[-1]["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small-qwen3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from roll_core.data import StatefulLoader, build_sft_dataset, collate_sft, load_rows
    from roll_core.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    examples, _ = build_sft_dataset(load_rows(str(DATA)), tok, fmt="prompt_response", max_length=64)
    loader = StatefulLoader(len(examples), args.batch, seed=0)
    n = args.warmup + args.steps
    batches = [
        collate_sft([examples[i] for i in next(loader)], pad_id=tok.pad_token_id) for _ in range(n)
    ]

    bases, ours = [], []
    for _ in range(args.rounds):  # alternate, so background load hits both alike
        bases.append(hand_written(path, batches, steps=args.steps, warmup=args.warmup, lr=args.lr))
        ours.append(
            roll_sft(
                args.model,
                steps=args.steps,
                warmup=args.warmup,
                batch=args.batch,
                lr=args.lr,
                threads=args.threads,
            )
        )
    base, mine = max(bases), max(ours)
    print(
        f"model {args.model}, batch {args.batch}, {args.steps} timed steps, "
        f"{args.threads} threads, best of {args.rounds} alternating rounds"
    )
    print(f"hand-written PyTorch loop: {base:10,.0f} tokens/s  rounds: {_fmt(bases)}")
    print(f"roll sft:                  {mine:10,.0f} tokens/s  rounds: {_fmt(ours)}")
    print(f"ratio roll / hand-written: {mine / base:.3f}")


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:,.0f}" for v in values)


if __name__ == "__main__":
    main()
