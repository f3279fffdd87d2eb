"""Packed sequences and token-budget micro-batches against right-padded row micro-batches.

A long-tailed length mix (lognormal, median 192 tokens, clipped to 32..2048; the last row
always 2048 long) on a random-init Qwen3-architecture model of ~30M parameters (hidden 512,
8 layers, vocabulary 8192), through the torch train backend's real `train_step` with the SFT
objective, fp32 on CPU. Each setting runs in its own subprocess (so its peak memory is its
own): one warm-up step, then `--steps` timed steps. Prints per setting the train tokens/s
(real tokens over process CPU time, steadier than wall time on a shared machine; wall time
too) and the peak resident memory above the loaded model, then the ratios.

Settings: `padded-rows` (the old path: `micro` rows right-padded to the batch's longest
row), `packed-rows` (the same rows packed), `packed-budget` (packed, at most `budget` real
tokens per micro-batch), `padded-budget` (padded, rows x longest <= budget).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/packing.py \
        [--rows 24] [--micro 4] [--budget 2048] [--steps 2] [--mix longtail|turns]

`--mix turns` (short rows of similar length, as agentic turns: uniform 96..192) is the case
where packing cannot win much and must not lose: there a dense-mask attention over one long
packed sequence would cost many times the padded path.
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

SETTINGS = {
    "padded-rows": {"packing": False, "budget": False},
    "packed-rows": {"packing": True, "budget": False},
    "padded-budget": {"packing": False, "budget": True},
    "packed-budget": {"packing": True, "budget": True},
}


def lengths(rows: int, mix: str = "longtail", seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if mix == "turns":  # short rows of similar length, as agentic turns (96..192 tokens)
        return torch.randint(96, 193, (rows,), generator=g).tolist()
    raw = torch.exp(torch.log(torch.tensor(192.0)) + torch.randn(rows, generator=g))
    out = raw.round().clamp(32, 2048).long().tolist()
    out[-1] = 2048  # the tail row every long-tailed batch has
    return out


def make_batch(rows: int, vocab: int, mix: str) -> object:
    from roll_core.data import Batch

    lens = lengths(rows, mix)
    width = max(lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    attn = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    loss_mask = attn.clone()
    loss_mask[:, :16] = 0  # a 16-token "prompt"
    return Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
        meta={"loss_tokens": int(loss_mask[:, 1:].sum())},
    )


def build_model(root: Path) -> tuple[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from roll_core.models import resolve_model_path

    tok = resolve_model_path("builtin:tiny-qwen3")
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(root / "model")
    return str(root / "model"), tok


def worker(args: argparse.Namespace) -> None:
    """One setting, in this process: prints one JSON line."""
    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.backends.train.torch_backend import TorchTrainBackend
    from roll_core.config.schema import OptimConfig
    from roll_core.workers.objectives import get_objective

    setting = SETTINGS[args.setting]
    backend = TorchTrainBackend(
        TrainBackendSpec(
            model_path=args.model,
            tokenizer_path=args.tokenizer,
            device="cpu",
            precision="fp32",
            optim=OptimConfig(lr=1e-4),
            total_steps=args.steps + 1,
            micro_batch_size=args.micro,
            num_threads=1,
            packing=setting["packing"],
            max_tokens_per_micro_batch=args.budget if setting["budget"] else None,
        )
    )
    batch = make_batch(args.rows, 8192, args.mix)
    objective = get_objective("sft")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, after the model loaded
    backend.train_step(batch.select([0, 1]), objective)  # warm-up on two rows
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = 0.0
    for _ in range(args.steps):
        tokens += backend.train_step(batch, objective)["perf/tokens"]
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    micro = len(backend.micro_batches(batch))
    print(
        json.dumps(
            {
                "setting": args.setting,
                "tokens_per_cpu_s": tokens / cpu,
                "tokens_per_wall_s": tokens / wall,
                "peak_mib_above_model": (peak - base) / 1024,
                "micro_batches": micro,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--micro", type=int, default=4, help="rows per row-count micro-batch")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per budget micro-batch")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--mix",
        choices=("longtail", "turns"),
        default="longtail",
        help="longtail: lognormal 32..2048 (RL responses); turns: uniform 96..192 (agentic turns)",
    )
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.setting:
        worker(args)
        return
    lens = lengths(args.rows, args.mix)
    print(
        f"rows {args.rows}, real tokens {sum(lens)}, padded slots {args.rows * max(lens)}; "
        f"lengths min {min(lens)} median {sorted(lens)[len(lens) // 2]} max {max(lens)}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_model(Path(tmp))
        results = {}
        for name in args.settings.split(","):
            cmd = [sys.executable, __file__, "--setting", name, "--model", model]
            cmd += ["--tokenizer", tok, "--rows", str(args.rows), "--micro", str(args.micro)]
            cmd += ["--budget", str(args.budget), "--steps", str(args.steps), "--mix", args.mix]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, check=True)
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            r = results[name]
            print(
                f"{name:14s} {r['tokens_per_cpu_s']:8.0f} tok/cpu-s {r['tokens_per_wall_s']:8.0f} "
                f"tok/wall-s  peak +{r['peak_mib_above_model']:7.0f} MiB  "
                f"{r['micro_batches']} micro-batches"
            )
    if "padded-rows" in results:
        ref = results["padded-rows"]
        for name, r in results.items():
            if name == "padded-rows":
                continue
            speed = r["tokens_per_cpu_s"] / ref["tokens_per_cpu_s"]
            memory = r["peak_mib_above_model"] / max(ref["peak_mib_above_model"], 1e-9)
            print(f"{name:14s} vs padded-rows: tokens/s x{speed:.2f}, peak memory x{memory:.2f}")


if __name__ == "__main__":
    main()
