"""Rollout engine: today's chunked path against request-level streaming, on one engine.

The same engine, model and requests in both arms (one inference rank, in this process):
* chunked: requests go in chunks of `--chunk-size` to the fixed-batch `generate(list)`, at
  most 2 chunks in flight (the deterministic rollout mode); a chunk answers when its longest
  response is done;
* streaming: every request through `generate_request` from its own thread; the engine
  batches continuously (at most `--chunk-size` live rows, so both arms decode as many rows at
  once; vllm: its own scheduler's max_num_seqs) and answers each request the moment it
  finishes.

Response lengths are heavy-tailed and fixed per request before the run: max_new_tokens of
request i is a lognormal draw (median `--median-len`, sigma `--sigma`, clipped to
[4, `--max-len`]). Streaming passes each request its own max_new_tokens; generate(list)
takes one SamplingParams per call, so a chunk runs to its longest request's length and each
response is then cut to its own length (exactly what happens today when a chunk's rows stop
at an eos at those lengths: finished rows ride along until the chunk is done). Decoding is
greedy by default, so both arms generate the same tokens and count the same number. The
model is a random-init Qwen2 (hidden 512, 8 layers, head_dim 64, ~27M params, the tiny
built-in's 320-token vocabulary), large enough that the forward passes dominate.

Prints generated tokens/s, the time to the last response, the median and p90 request
latency, and the ratio streaming / chunked.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/rollout_engine.py [--backend hf|vllm]
        [--requests 256] [--chunk-size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build_model(out: Path, *, seed: int = 0) -> Path:
    """A random-init Qwen2 with the tiny built-in's tokenizer (written once into `out`)."""
    if (out / "config.json").exists():
        return out
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from roll_core.models.builtin import materialize_builtin

    tiny = materialize_builtin("tiny-qwen3", out.parent / "cache")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=258,
        pad_token_id=256,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def make_requests(n: int, args: argparse.Namespace) -> tuple[list[Any], list[int]]:
    """`n` prompts (16..64 tokens) and their heavy-tailed response lengths (seeded)."""
    import numpy as np

    from roll_core.backends.infer import Request

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(args.median_len), args.sigma, n), 4, args.max_len)
    reqs = [
        Request(i, rng.integers(3, 250, int(rng.integers(16, 65))).tolist(), seed=i)
        for i in range(n)
    ]
    return reqs, [int(x) for x in lengths]


def chunked(backend: Any, reqs: list[Any], lengths: list[int], args: argparse.Namespace) -> dict:
    from roll_core.backends.infer import SamplingParams

    start = time.perf_counter()
    ends: list[float] = []
    tokens: list[int] = []
    rank = threading.Lock()

    def run(lo: int) -> None:
        chunk, lens = reqs[lo : lo + args.chunk_size], lengths[lo : lo + args.chunk_size]
        params = SamplingParams(max_new_tokens=max(lens), temperature=args.temperature)
        with rank:  # a worker runs one (non-concurrent) generate call at a time
            outs = backend.generate(chunk, params)
        done = time.perf_counter()
        for c, n in zip(outs, lens, strict=True):
            tokens.append(len(c.response_ids[:n]))
            ends.append(done)

    with ThreadPoolExecutor(2) as pool:  # at most 2 chunks in flight
        list(pool.map(run, range(0, len(reqs), args.chunk_size)))
    return _report(start, ends, tokens)


def streaming(backend: Any, reqs: list[Any], lengths: list[int], args: argparse.Namespace) -> dict:
    from roll_core.backends.infer import SamplingParams

    start = time.perf_counter()
    ends: list[float] = []
    tokens: list[int] = []

    def run(i: int) -> None:
        params = SamplingParams(max_new_tokens=lengths[i], temperature=args.temperature)
        c = backend.generate_request(reqs[i], params)
        ends.append(time.perf_counter())
        tokens.append(len(c.response_ids))

    with ThreadPoolExecutor(len(reqs)) as pool:
        list(pool.map(run, range(len(reqs))))
    return _report(start, ends, tokens)


def _report(start: float, ends: list[float], counts: list[int]) -> dict:
    import numpy as np

    lat = np.array(ends) - start
    wall, tokens = float(lat.max()), sum(counts)
    return {
        "tokens": tokens,
        "wall": wall,
        "tok_s": tokens / wall,
        "p50": float(np.median(lat)),
        "p90": float(np.quantile(lat, 0.9)),
    }


def make_backend(args: argparse.Namespace, path: Path) -> Any:
    if args.backend == "hf":
        from roll_core.backends.infer.hf import HFInferBackend

        return HFInferBackend(
            model_path=str(path),
            device=args.device,
            num_threads=args.threads,
            max_num_seqs=args.chunk_size,
        )
    from roll_core.backends.infer.vllm_backend import VLLMInferBackend

    return VLLMInferBackend(
        model_path=str(path),
        device=args.device,
        num_threads=args.threads,
        max_model_len=2048,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--median-len", type=float, default=24)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default="/tmp/roll-bench-rollout-engine/qwen2-512x8")
    args = parser.parse_args()

    path = build_model(Path(args.model_dir))
    backend = make_backend(args, path)
    reqs, lengths = make_requests(args.requests, args)
    warm = make_requests(4, argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
    chunked(backend, *warm, args)  # warm up both paths (allocator, threads)
    streaming(backend, *warm, args)
    rows: dict[str, list[dict]] = {"chunked": [], "streaming": []}
    for _ in range(args.rounds):
        for name, arm in (("chunked", chunked), ("streaming", streaming)):
            rows[name].append(arm(backend, reqs, lengths, args))
            r = rows[name][-1]
            print(f"  {name}: {r['tok_s']:,.0f} tokens/s, {r['wall']:.1f} s", flush=True)
    if hasattr(backend, "close"):
        backend.close()
    print(
        f"backend {args.backend} ({args.device}, {args.threads} threads): {args.requests} "
        f"requests, response lengths lognormal(median {args.median_len:g}, sigma "
        f"{args.sigma:g}) in [4, {args.max_len}] (sum {sum(lengths)}, max {max(lengths)}), "
        f"chunks of {args.chunk_size} (max 2 in flight) vs streaming (<= {args.chunk_size} "
        f"live rows), temperature {args.temperature:g}, best of {args.rounds}"
    )
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in rows.items()}
    for name, r in best.items():
        print(
            f"{name:10s} {r['tok_s']:9,.0f} tokens/s  last response {r['wall']:7.2f} s  "
            f"latency p50 {r['p50']:7.2f} s  p90 {r['p90']:7.2f} s  ({r['tokens']} tokens)"
        )
    c, s = best["chunked"], best["streaming"]
    print(
        f"ratio streaming / chunked: tokens/s {s['tok_s'] / c['tok_s']:.2f}x, time to last "
        f"response {c['wall'] / s['wall']:.2f}x shorter, p50 latency "
        f"{c['p50'] / s['p50']:.2f}x shorter"
    )


if __name__ == "__main__":
    main()
