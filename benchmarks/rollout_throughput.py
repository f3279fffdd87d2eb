"""Rollout throughput: the sample-level scheduler against one direct `generate` call.

Same model, same prompts, same sampling, in this one command:
* direct: the infer backend's `generate` on the whole batch (n x prompts requests) at once,
  then every reward computed afterwards (a barrier between generation and rewards);
* scheduler: the rollout producer (one-turn groups) in deterministic mode over the same ActorInfer workers (fixed
  chunks routed to the least loaded rank, rewards scored on a thread pool as each chunk
  completes). Streaming against chunked on one engine: benchmarks/rollout_engine.py.

Both compute the real math-verify reward on the arithmetic data. Prints generated tokens/s
(responses + rewards done) for each and the ratio.

    python benchmarks/rollout_throughput.py [--model builtin:tiny-qwen3] [--prompts 64] [--n 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny-qwen3")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from roll_core.backends.infer import Request, SamplingParams
    from roll_core.config.reward import RewardConfig
    from roll_core.data import encode_prompt, load_rows
    from roll_core.engine import Cluster, LocalExecutor
    from roll_core.models import load_tokenizer, resolve_model_path
    from roll_core.rollout.one_turn import Prompt, Sample, prompt_producer
    from roll_core.rollout.rewards import RewardStage
    from roll_core.workers.actor_infer import ActorInfer

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    rows = load_rows(str(ROOT / "data/tiny-arith/test.jsonl"), max_rows=args.prompts)
    prompts = [Prompt(i, encode_prompt(tok, r["prompt"]), dict(r)) for i, r in enumerate(rows)]
    stage = RewardStage(RewardConfig(), tokenizer=tok, domains={"math"})
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    threads = max(1, args.threads // args.ranks)
    infer = Cluster(
        "actor_infer",
        ActorInfer,
        LocalExecutor(),
        world_size=args.ranks,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": {"model_path": path, "device": "cpu", "num_threads": threads},
        },
    )
    infer.run("setup")

    def direct() -> tuple[int, float]:
        start = time.perf_counter()
        reqs = [
            Request(i * args.n + k, p.prompt_ids, seed=i * args.n + k)
            for i, p in enumerate(prompts)
            for k in range(args.n)
        ]
        outs = infer.run_rank0("generate", reqs, params)
        for r, c in zip(reqs, outs, strict=True):
            p = prompts[r.request_id // args.n]
            stage.score_sample(
                Sample(r.request_id, p.index, p, c.response_ids, c.log_probs, c.finish_reason, 0)
            )
        return sum(len(c.response_ids) for c in outs), time.perf_counter() - start

    def scheduled() -> tuple[int, float]:
        sched = prompt_producer(
            infer=infer,
            prompts=iter(prompts),
            reward_fn=stage.score_sample,
            params=params,
            n=args.n,
            prompts_per_step=len(prompts),
            deterministic=True,  # the chunked path (benchmarks/rollout_engine.py: streaming)
            chunk_size=args.chunk_size,
            max_chunks_in_flight=2,
            reward_workers=2,
        )
        start = time.perf_counter()
        out = sched.next_batch(step=1)
        wall = time.perf_counter() - start
        sched.close()
        return sum(len(s.response_ids) for g in out.groups for s in g), wall

    d_rates, s_rates = [], []
    for _ in range(args.rounds):
        tokens, wall = direct()
        d_rates.append(tokens / wall)
        tokens, wall = scheduled()
        s_rates.append(tokens / wall)
    d, s = max(d_rates), max(s_rates)
    print(
        f"model {args.model}: {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
        f"{args.ranks} infer rank(s), chunks of {args.chunk_size}, best of {args.rounds}"
    )
    print(
        f"direct generate + rewards after: {d:10,.0f} tokens/s  ({', '.join(f'{x:,.0f}' for x in d_rates)})"
    )
    print(
        f"sample-level scheduler:          {s:10,.0f} tokens/s  ({', '.join(f'{x:,.0f}' for x in s_rates)})"
    )
    print(f"ratio scheduler / direct: {s / d:.3f}")


if __name__ == "__main__":
    main()
