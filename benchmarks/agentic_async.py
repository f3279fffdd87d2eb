"""Agentic benchmark: lockstep rollout vs env-level async vs async + redundancy, one command.

Workload: `SlowEnv` (below), an env whose every step sleeps a heavy-tailed latency (Pareto,
as with a remote environment: the latency is the workload, not CPU work), 5 turns per episode.
Each arm runs the real `roll train agentic` CLI (built-in tiny model, real generation and real
training) with the same recipe and the same number of steps and episodes per step, and differs
only in how the rollout runs:

* ``sync``: lockstep batch rollout (``rollout.turn_barrier``: every episode waits for all the
  others at each turn) and no overlap with training: the baseline of batch-synchronous
  agentic pipelines;
* ``async``: env-level async rollout (each episode its own loop, no barrier), still no
  overlap with training (``async_generation_ratio: 0``);
* ``async-overlap``: env-level async + ``async_generation_ratio: 1`` (episodes keep running
  while training), no redundancy;
* ``async-redundant``: env-level async + ``redundant_groups: 2`` (2 whole groups launched
  per step beyond the 4 needed; the first to finish are kept) + ``async_generation_ratio: 1``
  (episodes keep running while training, freshness bound 1 version per trajectory);
* ``async-redundant-uncorrected``: ``async-redundant`` with ``algorithm.rollout_correction:
  null``. Async recipes get token TIS by default (each token weighted by min(pi_old /
  pi_behaviour, 2): the stale turns' behaviour policy corrected), so ``async-overlap`` and
  ``async-redundant`` run with it; this arm turns it off, as every async arm ran before that
  default (it collapsed in 1 seed of 3 on FrozenLake). Not in the default arms; name it in
  ``--arms``.

It prints episodes trained per second from the start of the first training step to the end
of the last (model loading and process start excluded, the async pipeline's fill included),
the mean step time, and each arm's speedup over ``sync``.

    python benchmarks/agentic_async.py [--steps 8] [--latency-scale 0.02]
                                       [--arms sync,async,async-overlap,async-redundant]
                                       [--task coin|frozenlake] [--warm-start-steps N]
                                       [--eval-episodes 128] [--seeds 0 1 2]

``--task frozenlake`` runs the same arms on a real task instead: recipes/tiny-frozenlake.yaml
(format warm start, step-wise GiGPO) on ``SlowFrozenLake``, FrozenLake whose every step sleeps
the same heavy-tailed latency, and also prints each arm's held-out success (`--eval-episodes`
maps, 128 by default, after the warm start and after the last step), so whether learning
survives the asynchrony is measured next to the speedup (the last validation's time is left
out of the speed window). Steps and warm-up steps default to the recipe's; the warm-up's
random-action demonstrations run without the latency; `--keep-runs DIR` keeps each arm's run.
``--seeds 0 1 2`` runs every arm once per recipe seed (training env seeds, sampling, latency
draws; the built-in model's init and the held-out maps stay the same) and adds a summary: the median speedup and, per arm, the held-out success after
the last step per seed, its mean and its mean difference to the same seed's sync run.

The latency is seeded, so every arm sees the same distribution; timings are wall clock on a
shared machine (see docs/agentic.md).
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
from typing import Any

import numpy as np
import yaml

from roll_core.envs import EnvOptions, FrozenLakeEnv, TextEnv, Transition
from roll_core.envs.frozen_lake import FrozenLakeOptions
from roll_core.pipelines.warm_start import DEMO_SEED_START

ROOT = Path(__file__).resolve().parents[1]
ROLL = str(Path(sys.executable).with_name("roll"))


class SlowEnvOptions(EnvOptions):
    """Options of SlowEnv (see the module docstring)."""

    turns: int = 5
    latency_scale_s: float = 0.02
    pareto_shape: float = 1.2
    latency_cap_s: float = 4.0


class SlowEnv(TextEnv):
    """Any answer is accepted; each step sleeps ``scale * (1 + Pareto(shape))`` seconds
    (capped), drawn from a generator seeded by the episode seed and a per-instance counter, so
    episodes of one group see different latencies."""

    name = ""
    Options = SlowEnvOptions
    options: SlowEnvOptions
    instructions = "Say anything."
    _instances = 0

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        SlowEnv._instances += 1
        self.latency_rng = np.random.default_rng([int(rng.integers(1 << 31)), self._instances])
        self.t = 0
        self.target = int(rng.integers(2))
        return "turn 0", {}

    def parse_action(self, text: str) -> str:
        return text

    def on_step(self, action: str) -> Transition:
        o = self.options
        delay = o.latency_scale_s * (1.0 + self.latency_rng.pareto(o.pareto_shape))
        time.sleep(min(o.latency_cap_s, delay))
        self.t += 1
        done = self.t >= o.turns
        reward = float(done and (len(action) % 2 == self.target))
        return Transition(f"turn {self.t}", reward, done, {"success": reward > 0})

    def render(self) -> str:
        return f"turn {self.t}"


class SlowFrozenLakeOptions(FrozenLakeOptions):
    """FrozenLake's options plus SlowEnv's latency."""

    latency_scale_s: float = 0.02
    pareto_shape: float = 1.2
    latency_cap_s: float = 4.0


class SlowFrozenLake(FrozenLakeEnv):
    """The real task (``--task frozenlake``): FrozenLake whose every step first sleeps
    ``scale * (1 + Pareto(shape))`` seconds (capped), as SlowEnv; maps and moves are those of
    ``frozen_lake`` (the latency generator is drawn after the map)."""

    name = ""
    Options = SlowFrozenLakeOptions
    options: SlowFrozenLakeOptions
    _instances = 0
    slow = True  # False for the warm start's demonstrations (see reset)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        # The warm start's random-action demonstrations (seeds from DEMO_SEED_START) run
        # without the latency: they are outside the timed window, and at 32 sequential
        # episodes per warm-up step the latency alone would add ~10 minutes per arm.
        self.slow = seed is None or seed < DEMO_SEED_START
        return super().reset(seed)

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        observation, info = super().on_reset(rng)
        SlowFrozenLake._instances += 1
        self.latency_rng = np.random.default_rng([int(rng.integers(1 << 31)), self._instances])
        return observation, info

    def on_step(self, action: str) -> Transition:
        o = self.options
        delay = o.latency_scale_s * (1.0 + self.latency_rng.pareto(o.pareto_shape))
        if self.slow:
            time.sleep(min(o.latency_cap_s, delay))
        return super().on_step(action)


ARMS: dict[str, dict[str, Any]] = {
    "sync": {"turn_barrier": True, "async_generation_ratio": 0, "redundant_groups": 0},
    "async": {"turn_barrier": False, "async_generation_ratio": 0, "redundant_groups": 0},
    "async-overlap": {
        "turn_barrier": False,
        "async_generation_ratio": 1,
        "redundant_groups": 0,
    },
    "async-redundant": {
        "turn_barrier": False,
        "async_generation_ratio": 1,
        "redundant_groups": 2,
    },
    "async-redundant-uncorrected": {
        "turn_barrier": False,
        "async_generation_ratio": 1,
        "redundant_groups": 2,
    },
}
# algorithm keys an arm adds to the recipe's (the rollout keys above differ per arm)
ARM_ALGORITHM: dict[str, dict[str, Any]] = {
    "async-redundant-uncorrected": {"rollout_correction": None},
}


def recipe(
    tmp: Path,
    name: str,
    steps: int | None,
    latency: float,
    task: str,
    warm: int | None,
    eval_episodes: int,
    *,
    arm: str | None = None,
) -> Path:
    """The recipe of arm ``arm`` (default: ``name``), written to ``tmp/<name>.yaml``."""
    arm = arm or name
    data = (
        _frozenlake(steps, latency, warm, eval_episodes)
        if task == "frozenlake"
        else _coin(steps or 6, latency)
    )
    data["name"] = f"bench-agentic-{task}-{arm}"
    data["runs_dir"] = str(tmp / "runs")
    data["rollout"].update(ARMS[arm])
    data.setdefault("algorithm", {}).update(ARM_ALGORITHM.get(arm, {}))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _coin(steps: int, latency: float) -> dict[str, Any]:
    return {
        "pipeline": "agentic",
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [
            {
                "env": "benchmarks.agentic_async:SlowEnv",
                "options": {"latency_scale_s": latency},
                "system_prompt": "Say anything.",
                "groups_per_step": 4,
                "eval_episodes": 0,
            }
        ],
        "rollout": {
            "mode": "trajectory",
            "group_size": 4,
            "max_new_tokens": 4,
            "step_timeout_s": 30,
        },
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "trainer": {"max_steps": steps, "micro_batch_size": 16},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-4}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": 1000, "export_final": False},
        "tracking": {"backends": ["jsonl"]},
    }


def _frozenlake(
    steps: int | None, latency: float, warm: int | None, eval_episodes: int
) -> dict[str, Any]:
    """recipes/tiny-frozenlake.yaml on SlowFrozenLake, validated after the warm start and at
    the last step (`eval_episodes` held-out maps)."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-frozenlake.yaml").read_text())
    env = data["envs"][0]
    env["env"] = "benchmarks.agentic_async:SlowFrozenLake"
    env["options"] = {**env["options"], "latency_scale_s": latency}
    env["eval_episodes"] = eval_episodes
    data["rollout"]["step_timeout_s"] = 30
    data["warm_start"]["steps"] = data["warm_start"]["steps"] if warm is None else warm
    data["trainer"]["max_steps"] = steps = steps or data["trainer"]["max_steps"]
    data["eval"]["every_steps"] = steps
    data["actor_train"]["num_threads"] = data["actor_infer"]["num_threads"] = 1
    data["checkpoint"] = {"every_steps": 1000, "export_final": False}
    data["tracking"] = {"backends": ["jsonl"]}
    return dict(data)


def run_arm(
    tmp: Path, arm: str, args: argparse.Namespace, env: dict[str, str], seed: int = 0
) -> dict[str, float]:
    start = time.perf_counter()
    run_id = arm if len(args.seeds) == 1 else f"{arm}-seed{seed}"
    path = recipe(
        tmp,
        run_id,
        None if args.steps is None else max(3, args.steps),
        args.latency_scale,
        args.task,
        args.warm_start_steps,
        args.eval_episodes,
        arm=arm,
    )
    data = yaml.safe_load(path.read_text())
    data["seed"] = seed  # the training env seeds, sampling and the latency draws
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = subprocess.run(
        [ROLL, "train", "agentic", str(path), "--run-id", run_id],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode:
        sys.exit(f"arm {run_id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    rows = [
        json.loads(x)
        for x in (tmp / "runs" / run_id / "metrics.jsonl").read_text().split("\n")
        if x
    ]
    timed = [r for r in rows if r["step"] > 0]
    # From the start of the first step (the time of its row minus its duration) to the end of
    # the last: an async arm's pipeline fill is paid inside the window, and the work it does
    # ahead of the last step (groups generated but never trained) counts as a cost. The
    # validation at the last step is not training: its time is left out.
    wall = timed[-1]["time"] - (timed[0]["time"] - timed[0]["perf/step_s"])
    wall -= timed[-1].get("eval/wall_s", 0.0)
    evals = [r for r in rows if "eval/success_rate" in r]
    # episodes trained per step (in step mode perf/samples counts turns, not episodes)
    episodes = data["rollout"]["group_size"] * data["envs"][0]["groups_per_step"] * len(timed)
    return {
        "episodes_per_s": episodes / wall,
        "step_s": wall / len(timed),
        "rollout_s": sum(r["time/rollout"] for r in timed) / len(timed),
        "env_share": sum(r["rollout/env_time_share"] for r in timed) / len(timed),
        "stale_dropped": sum(r.get("rollout/groups_dropped_stale", 0.0) for r in timed),
        # episodes played (finished or cancelled by redundancy) per episode trained: the extra
        # env work redundancy and running ahead cost
        "run_per_trained": sum(
            v
            for r in timed
            for k, v in r.items()
            if k.endswith(("/episodes_completed", "/episodes_cancelled"))
        )
        / episodes,
        "process_s": time.perf_counter() - start,
        # held-out success after the warm start (step 0) and after the last step
        "success_start": evals[0]["eval/success_rate"] if evals else float("nan"),
        "success_end": evals[-1]["eval/success_rate"] if len(evals) > 1 else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per arm (>= 3; default: 6 for coin, the recipe's for frozenlake)",
    )
    parser.add_argument("--arms", default="sync,async,async-overlap,async-redundant")
    parser.add_argument(
        "--latency-scale", type=float, default=0.02, help="seconds; latency = scale x (1 + Pareto)"
    )
    parser.add_argument(
        "--task",
        choices=("coin", "frozenlake"),
        default="coin",
        help="coin: SlowEnv (no learning, speed only); frozenlake: recipes/tiny-frozenlake.yaml "
        "on FrozenLake with the same latency, held-out success per arm",
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="frozenlake: format warm-up SFT steps (default: the recipe's)",
    )
    parser.add_argument(
        "--eval-episodes", type=int, default=128, help="frozenlake: held-out maps per validation"
    )
    parser.add_argument(
        "--keep-runs", default=None, help="keep the arms' run directories under this path"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="run every arm once per seed (seed by seed, the arms interleaved) and add a "
        "summary over seeds",
    )
    args = parser.parse_args()
    arms = args.arms.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    per_seed: dict[int, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep_runs) if args.keep_runs else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            per_seed[seed] = {}
            for arm in arms:
                print(f"arm {arm} seed {seed} ...", flush=True)
                per_seed[seed][arm] = run_arm(out, arm, args, env, seed)
    for seed, results in per_seed.items():
        if len(per_seed) > 1:
            print(f"\nseed {seed}")
        print_tables(results, args.task)
    if len(per_seed) > 1:
        print_summary(per_seed, arms, args.task)


def _speedups(results: dict[str, dict[str, float]]) -> dict[str, float]:
    base = results.get("sync", next(iter(results.values())))["episodes_per_s"]
    return {arm: r["episodes_per_s"] / base for arm, r in results.items()}


def print_summary(
    per_seed: dict[int, dict[str, dict[str, float]]], arms: list[str], task: str
) -> None:
    """Per arm over seeds: the median speedup (each against its own seed's sync run) and, for
    a real task, the held-out success after the last step per seed, its mean, and the mean of
    its difference to sync (same seed)."""
    seeds = list(per_seed)
    print(f"\nsummary over seeds {', '.join(map(str, seeds))}")
    header = f"{'arm':<18}{'speedup (median)':>18}"
    if task == "frozenlake":
        header += f"{'success after last step, per seed':>36}{'mean':>8}{'vs sync':>9}"
    print(header)
    for arm in arms:
        speed = float(np.median([_speedups(per_seed[s])[arm] for s in seeds]))
        line = f"{arm:<18}{speed:>17.2f}x"
        if task == "frozenlake":
            ends = [per_seed[s][arm]["success_end"] for s in seeds]
            values = " ".join(f"{e:.1%}" for e in ends)
            line += f"{values:>36}{np.mean(ends):>8.1%}"
            if "sync" in per_seed[seeds[0]]:
                syncs = [per_seed[s]["sync"]["success_end"] for s in seeds]
                diff = np.mean([e - b for e, b in zip(ends, syncs, strict=True)])
                line += f"{diff * 100:>+8.1f}p"
        print(line)


def print_tables(results: dict[str, dict[str, float]], task: str) -> None:
    speedup = _speedups(results)
    print(
        f"\n{'arm':<18}{'episodes/s':>12}{'step s':>9}{'rollout s':>11}{'env share':>11}"
        f"{'stale':>7}{'run/trained':>13}{'speedup':>9}"
    )
    for arm, r in results.items():
        print(
            f"{arm:<18}{r['episodes_per_s']:>12.2f}{r['step_s']:>9.2f}{r['rollout_s']:>11.2f}"
            f"{r['env_share']:>11.2f}{r['stale_dropped']:>7.0f}{r['run_per_trained']:>13.2f}"
            f"{speedup[arm]:>8.2f}x"
        )
    if task == "frozenlake":
        print(f"\n{'arm':<18}{'held-out success after warm start':>35}{'after last step':>17}")
        for arm, r in results.items():
            print(f"{arm:<18}{r['success_start']:>35.1%}{r['success_end']:>17.1%}")


if __name__ == "__main__":
    main()
