"""Code-reward throughput: a fixed timeout vs RollPacker's adaptive timeout.

    python benchmarks/reward_timeout.py [--problems 20] [--samples 8] [--loop-share 0.05]

The workload is what a GRPO step hands the code reward: ``problems x samples`` responses,
``samples`` per problem; each problem has its own cost (a busy loop of 20-200 ms of CPU)
and each correct response takes 0.8-1.5x of it; ``loop-share`` of the responses (5%, about
what RollPacker reports) never terminate. Both runs score the same responses in the same
(shuffled) order through :class:`~roll_core.rewards.code.CodeReward` in the real sandbox,
with ``--threads`` scoring threads and ``--concurrent`` sandbox slots.

* fixed: every case gets ``--fixed-s`` (T_max) seconds.
* adaptive: ``min(max(T_min, lam * T_anchor), T_max)``, per problem.

Prints executions/s for both, the ratio, and how many correct programs each run killed
(false timeouts: must stay 0 for the adaptive timeout to be worth it).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

from roll_core.config.reward_options import CodeRewardConfig
from roll_core.rewards.base import RewardSample
from roll_core.rewards.code import CodeReward

GOOD = (
    "import time\n"
    "n = int(input())\n"
    "end = time.process_time() + {seconds}\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "print(n * 2)\n"
)
LOOP = "n = int(input())\nwhile True:\n    n += 1\n"


def workload(args: argparse.Namespace) -> list[tuple[RewardSample, bool]]:
    rng = random.Random(args.seed)
    items = []
    total = args.problems * args.samples
    loops = set(rng.sample(range(total), max(1, round(args.loop_share * total))))
    for p in range(args.problems):
        cost = rng.uniform(0.02, 0.2)
        tests = json.dumps([{"input": f"{p}\n", "output": f"{2 * p}\n"}])
        for s in range(args.samples):
            i = p * args.samples + s
            code = (
                LOOP if i in loops else GOOD.format(seconds=round(cost * rng.uniform(0.8, 1.5), 3))
            )
            response = f"```python\n{code}```"
            items.append((RewardSample(f"problem {p}", response, {"tests": tests}), i in loops))
    rng.shuffle(items)
    return items


def run(name: str, cfg: CodeRewardConfig, items, threads: int) -> dict[str, float]:
    reward = CodeReward(cfg)
    reward.warmup()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda item: reward(item[0]), items))
    seconds = time.perf_counter() - start
    metrics = reward.metrics()
    false_timeouts = sum(
        r.info["timeouts"] > 0 for r, (_, loops) in zip(results, items, strict=True) if not loops
    )
    out = {
        "executions": float(len(items)),
        "seconds": seconds,
        "exec_per_s": len(items) / seconds,
        "passed": float(sum(r.score == 1.0 for r in results)),
        "timeouts": metrics.get("code/timeouts", 0.0),
        "false_timeouts": float(false_timeouts),
        "exec_ms_p50": metrics.get("code/exec_ms_p50", 0.0),
        "exec_ms_p99": metrics.get("code/exec_ms_p99", 0.0),
        "timeout_s_mean": metrics.get("code/timeout_s_mean", 0.0),
    }
    print(f"{name:9s} " + "  ".join(f"{k}={v:.3g}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--loop-share", type=float, default=0.05)
    parser.add_argument("--fixed-s", type=float, default=5.0, help="T_max (the fixed timeout)")
    parser.add_argument("--min-s", type=float, default=0.5, help="T_min")
    parser.add_argument("--lam", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--mode", default="auto", choices=["auto", "namespaces", "rlimits"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = workload(args)
    sandbox = {"mode": args.mode, "max_concurrent": args.concurrent}
    fixed = CodeRewardConfig.model_validate(
        {"timeout": {"adaptive": False, "max_s": args.fixed_s}, "sandbox": sandbox}
    )
    adaptive = CodeRewardConfig.model_validate(
        {
            "timeout": {"min_s": args.min_s, "max_s": args.fixed_s, "lam": args.lam},
            "sandbox": sandbox,
        }
    )
    loops = sum(loop for _, loop in items)
    print(
        f"workload: {len(items)} executions, {loops} never terminate "
        f"({100 * loops / len(items):.1f}%), {args.threads} threads, {args.concurrent} sandbox "
        f"slots, T_max={args.fixed_s:g} s, T_min={args.min_s:g} s, lambda={args.lam:g}"
    )
    a = run("fixed", fixed, items, args.threads)
    b = run("adaptive", adaptive, items, args.threads)
    print(f"ratio adaptive/fixed executions/s: {b['exec_per_s'] / a['exec_per_s']:.2f}x")


if __name__ == "__main__":
    main()
