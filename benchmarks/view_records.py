"""Cost of the rollout records (`tracking.rollout_records`, docs/view.md) on the tiny RLVR recipe.

Two arms of the real `roll train rlvr recipes/tiny-arith-rlvr.yaml` CLI, the same steps and
seed, records on (the default: 8 rows a step) and off, alternated `--repeats` times. Prints
the median step time of each arm (step 1 left out: it warms up) in wall seconds and in CPU
seconds of the run's process (`perf/process_cpu_total_s` differences: every role runs in it
under `executor: local`, and CPU time is steadier than wall time on a shared machine), the
ratio of the arms, and the record's own time (`time/records`, measured inside the step) as a
share of the step. The model is runs/tiny-arith-sft/final when it exists (`nox -s demo` makes it),
else the random-init built-in tiny model, or `--model PATH`.

    OMP_NUM_THREADS=1 python benchmarks/view_records.py [--steps 8] [--repeats 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLL = str(Path(sys.executable).with_name("roll"))


def run_arm(runs: Path, name: str, records: bool, steps: int, model: str) -> list[dict]:
    overrides = [
        f"runs_dir={runs}",
        f"model.path={model}",
        f"trainer.max_steps={steps}",
        "eval.every_steps=null",
        "checkpoint.every_steps=1000",
        "checkpoint.export_final=false",
        "tracking.backends=[jsonl]",
        f"tracking.rollout_records.enabled={str(records).lower()}",
    ]
    args = [ROLL, "train", "rlvr", "recipes/tiny-arith-rlvr.yaml", "--run-id", name, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{name} failed:\n{res.stderr[-3000:]}")
    lines = (runs / name / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "perf/step_s" in r]
    for before, row in zip(rows, rows[1:], strict=False):
        row["cpu_s"] = row["perf/process_cpu_total_s"] - before["perf/process_cpu_total_s"]
    return rows[1:]  # step 1 warms up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None, help="model path (default: see above)")
    args = p.parse_args()
    sft = ROOT / "runs/tiny-arith-sft/final"
    model = args.model or (str(sft) if (sft / "config.json").is_file() else "builtin:tiny-qwen3")
    print(f"model: {model}")
    step_s: dict[str, list[float]] = {"on": [], "off": []}
    cpu_s: dict[str, list[float]] = {"on": [], "off": []}
    shares: list[float] = []
    spent = [0.0, 0.0]  # time/records and step time summed over the "on" arm's steps
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for arm in ("on", "off"):
                rows = run_arm(Path(tmp), f"{arm}-{k}", arm == "on", args.steps, model)
                step_s[arm] += [r["perf/step_s"] for r in rows]
                cpu_s[arm] += [r["cpu_s"] for r in rows]
                if arm == "on":
                    shares += [r["time/records"] / r["perf/step_s"] for r in rows]
                    spent[0] += sum(r["time/records"] for r in rows)
                    spent[1] += sum(r["perf/step_s"] for r in rows)
                    size = sum(f.stat().st_size for f in (Path(tmp) / f"on-{k}/rollouts").iterdir())
    on, off = statistics.median(step_s["on"]), statistics.median(step_s["off"])
    print(f"steps per arm: {args.steps} x {args.repeats} (step 1 left out)")
    print(f"median step time: records on {on:.3f} s, off {off:.3f} s; ratio {on / off:.3f}")
    con, coff = statistics.median(cpu_s["on"]), statistics.median(cpu_s["off"])
    print(f"median step CPU time: records on {con:.3f} s, off {coff:.3f} s; ratio {con / coff:.3f}")
    print(
        f"record's own time: median {100 * statistics.median(shares):.2f}% of the step "
        f"(max {100 * max(shares):.2f}%), in total {100 * spent[0] / spent[1]:.2f}% of the "
        f"steps' time; {size / args.steps / 1024:.1f} KiB a step"
    )


if __name__ == "__main__":
    main()
