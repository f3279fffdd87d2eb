"""RLVR long-tail benchmark: synchronous vs async (ratio 1 and 2) training, one command.

Workload: multi-term sums that write every partial sum (roll_core/data/sums.py, 2-30 terms,
P(k) ~ k^-1.2), so response lengths are long-tailed. The built-in tiny model gets a short SFT
warm start on the task (cached under --cache), then each arm runs the real `roll train rlvr`
CLI with the same recipe, the same number of steps and samples per step (same total
compute: every arm trains on exactly steps x prompts x n samples), and differs only in
`rollout.async_generation_ratio` (async arms: partial rollout, requests aborted at a weight
sync and continued from their prefix). Streaming generation (the default rollout mode). Reads
each run's metrics.jsonl and prints samples/s,
step time, generation idle fraction, held-out accuracy (greedy, after the same number of
samples) and the speedup over sync.

    python benchmarks/rlvr_async.py [--steps 8] [--arms sync,async1,async2]
                                    [--kl-coef 0.04] [--executor ray|local] [--repeats 3]

Timings are wall clock on whatever machine runs it; on a small shared CPU generation and
training compete for the same cores (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROLL = str(Path(sys.executable).with_name("roll"))


def sh(args: list[str], env: dict[str, str]) -> None:
    t = time.perf_counter()
    res = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(f"  done in {time.perf_counter() - t:.0f} s: {' '.join(args[1:3])}", flush=True)


def warm_start(cache: Path, steps: int, env: dict[str, str]) -> Path:
    from roll_core.data.sums import write_sums_dataset

    data = cache / "data"
    if not (data / "test.jsonl").exists():
        write_sums_dataset(data, n_train=20000, n_test=200, seed=0)
    final = cache / "runs" / "sums-sft" / "final"
    if (final / "model.safetensors").exists():
        print(f"warm start: cached {final}")
        return final
    recipe = {
        "pipeline": "sft",
        "name": "sums-sft",
        "seed": 0,
        "runs_dir": str(cache / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {"train": {"path": str(data / "train.jsonl")}, "format": "prompt_response",
                 "max_length": 160},
        "trainer": {"max_steps": steps, "micro_batch_size": 32, "log_every_steps": 50},
        "actor_train": {"optim": {"lr": 3.0e-3, "weight_decay": 0.0, "warmup_steps": 30,
                                  "scheduler": "cosine", "min_lr_ratio": 0.05}},
        "checkpoint": {"every_steps": steps, "keep_last": 1},
        "tracking": {"backends": ["jsonl"]},
    }  # fmt: skip
    path = cache / "sums-sft.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    print(f"warm start: SFT {steps} steps on multi-term sums (cached afterwards)", flush=True)
    sh([ROLL, "sft", str(path), "--run-id", "sums-sft"], env)
    return final


ARMS = {
    "sync": {},
    "sync-2t": {"threads": 2},  # sync with 2 torch threads per role (they take turns)
    "async1": {"async_generation_ratio": 1, "partial_rollout": True},
    "async2": {"async_generation_ratio": 2, "partial_rollout": True},
}


def run_arm(name: str, model: Path, cache: Path, args: argparse.Namespace, env: dict) -> Path:
    rollout = {
        "n": args.n,
        "prompts_per_step": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
    }
    arm = dict(ARMS[name])
    threads = arm.pop("threads", args.threads)
    rollout |= arm
    executor: dict[str, object] = {"type": "local"}
    if args.executor == "ray":
        # One Ray actor process per role (actor_train, actor_infer, reference): generation and
        # training run in separate processes, so they overlap without sharing one GIL. Each
        # role reserves 1 logical Ray CPU (roll_core/pipelines/rlvr.py); num_cpus is Ray's
        # logical count, sized so every role fits; the physical budget is the machine's cores.
        executor = {"type": "ray", "num_cpus": args.ray_cpus}
    run_id = f"bench-{name}-{int(time.time())}"
    recipe = {
        "pipeline": "rlvr",
        "name": f"rlvr-async-bench-{name}",
        "seed": 0,
        "runs_dir": str(cache / "runs"),
        "model": {"path": str(model)},
        "data": {"train": {"path": str(cache / "data/train.jsonl")},
                 "eval": {"path": str(cache / "data/test.jsonl")}, "max_prompt_length": 128},
        "rollout": rollout,
        "algorithm": {"preset": "grpo", "policy_loss": "decoupled_ppo",
                      "kl": {"coef": args.kl_coef}},
        "reward": {"domains": {"math": "math"}},
        "trainer": {"max_steps": args.steps, "micro_batch_size": 32},
        "executor": executor,
        "actor_train": {"num_threads": threads, "optim": {"lr": 2.0e-5, "warmup_steps": 0,
                        "scheduler": "constant", "max_grad_norm": 1.0}},
        "actor_infer": {"num_threads": threads},
        "eval": {"every_steps": args.steps, "max_samples": args.eval_samples},
        "checkpoint": {"every_steps": 10_000, "keep_last": 1},
        "tracking": {"backends": ["jsonl"]},
    }  # fmt: skip
    path = cache / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    print(f"arm {name}: executor {executor}, {threads} thread(s)/role, {rollout}", flush=True)
    sh([ROLL, "train", "rlvr", str(path), "--run-id", run_id], env)
    return cache / "runs" / run_id


def summarise(run: Path, samples_per_step: int) -> dict[str, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "perf/step_s" in r]
    wall = sum(r["perf/step_s"] + r.get("sync/seconds", 0.0) for r in steps)
    wall += sum(r.get("async/sync_pause_s", 0.0) - r.get("sync/seconds", 0.0) for r in steps)
    if any("rollout/gen_idle_fraction" in r for r in steps):
        idle = sum(r["rollout/gen_idle_fraction"] * r["rollout/wall_s"] for r in steps) / sum(
            r["rollout/wall_s"] for r in steps
        )
    else:  # sync: generation runs only inside the rollout phase of each step
        idle = 1 - sum(r.get("rollout/gen_active_s", 0.0) for r in steps) / wall
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    last = steps[-1]
    return {
        "samples_per_s": samples_per_step * len(steps) / wall,
        "step_s": wall / len(steps),
        "gen_idle": idle,
        "acc_start": evals[0] if evals else float("nan"),
        "acc_end": evals[-1] if evals else float("nan"),
        "resp_len_mean": sum(r["rollout/response_length_mean"] for r in steps) / len(steps),
        "resp_len_max": max(r["rollout/response_length_max"] for r in steps),
        "dropped_stale": last.get("async/dropped_stale", 0.0),
        "staleness_mean": last.get("async/staleness_mean", 0.0),
        "partial": sum(r.get("async/partial_samples", 0.0) for r in steps),
        # generated / trained samples: > 1 is generation thrown away (stale or left over)
        "gen_per_trained": sum(r["rollout/samples_generated"] for r in steps)
        / (samples_per_step * len(steps)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=112)
    p.add_argument("--threads", type=int, default=1, help="torch threads per role")
    p.add_argument(
        "--executor",
        choices=("ray", "local"),
        default="ray",
        help="ray (default): each role is its own Ray actor process, so generation and "
        "training really run at the same time; local: all roles are threads of one process "
        "(one GIL). Every arm uses the same executor.",
    )
    p.add_argument("--ray-cpus", type=int, default=3, help="logical CPUs of the local Ray cluster")
    p.add_argument("--eval-samples", type=int, default=100)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument(
        "--kl-coef",
        type=float,
        default=0.04,
        help="KL-to-reference loss coefficient (the grpo preset's 0.04); 0 drops the reference "
        "model, as DAPO-style recipes do, which shortens the trainer's phase",
    )
    p.add_argument("--arms", default="sync,async1,async2")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the arms this many times, alternating their order (ABC, CBA, ...) so load "
        "drift on a shared machine hits every arm alike; the median samples/s is reported",
    )
    p.add_argument("--cache", default=str(ROOT / ".cache" / "bench-rlvr-async"))
    args = p.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    model = warm_start(cache, args.sft_steps, env)
    names = args.arms.split(",")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for k in range(args.repeats):
        for name in names if k % 2 == 0 else names[::-1]:
            out = summarise(run_arm(name, model, cache, args, env), args.prompts * args.n)
            runs[name].append(out)
            load = os.getloadavg()[0]
            print(
                f"  {name} repeat {k}: {out['samples_per_s']:.2f} samples/s (load {load:.1f})",
                flush=True,
            )
    results = {}
    for name, outs in runs.items():
        ranked = sorted(outs, key=lambda r: r["samples_per_s"])
        results[name] = ranked[len(ranked) // 2]  # the median run (upper median if even)
        results[name]["all_samples_per_s"] = [r["samples_per_s"] for r in outs]  # type: ignore[assignment]
    base = results.get("sync")
    print(
        f"\nRLVR long-tail: {args.steps} steps x {args.prompts * args.n} samples per arm, "
        f"median of {args.repeats} run(s), executor {args.executor}, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    head = f"{'arm':12}{'samples/s':>10}{'step s':>8}{'gen idle':>9}{'acc0':>7}{'acc':>7}"
    print(
        head + f"{'len mean/max':>14}{'stale drop':>11}{'partial':>8}{'gen/train':>10}"
        f"{'speedup':>8}"
    )
    for name, r in results.items():
        speed = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        print(
            f"{name:12}{r['samples_per_s']:10.2f}{r['step_s']:8.2f}{r['gen_idle']:9.2f}"
            f"{r['acc_start']:7.3f}{r['acc_end']:7.3f}"
            f"{r['resp_len_mean']:8.1f}/{r['resp_len_max']:<5.0f}{r['dropped_stale']:11.0f}"
            f"{r['partial']:8.0f}{r['gen_per_trained']:10.2f}{speed:7.2f}x"
        )
    for name, r in results.items():
        print(f"  {name}: samples/s of every repeat {r['all_samples_per_s']}")
    (cache / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
