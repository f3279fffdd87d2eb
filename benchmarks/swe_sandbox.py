"""SWE sandbox cost per episode: creation, commands, grading; many episodes at once.

    python benchmarks/swe_sandbox.py TASKS_DIR [--episodes 8] [--slots 2] [--split test]

Each episode is what a scripted expert does in the coding env: create a sandbox from the
task's repository, read the buggy module, run the visible tests, apply the reference fix with
``git apply``, run the tests again, take the workspace's diff and close; then the diff is
graded in a fresh sandbox (:func:`roll_core.swe.grading.grade`). ``--episodes`` run at
once on threads, sharing ``--slots`` command slots of one :class:`LocalBackend` (the bound
on CPU). Prints one JSON object: per-phase mean and max seconds, episodes solved, lost
(an exception anywhere), and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from roll_core.sandbox import LocalBackend, SandboxSpec
from roll_core.swe.grading import grade, pytest_command
from roll_core.swe.task import SweTask, load_tasks


def episode(task: SweTask, backend: LocalBackend, spec: SandboxSpec) -> dict[str, float]:
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    box = backend.create(task.repo_dir, spec)
    times["create_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        module = task.meta.get("module", "").replace(".", "/") + ".py"
        box.exec(f"cat {module} | head -50", 30)
        box.exec(pytest_command(list(task.pass_to_pass)[:20]), 120)
        applied = box.exec("git apply -", 30, stdin=task.patch)
        assert applied.ok, applied.output()
        box.exec(pytest_command(list(task.pass_to_pass)[:20]), 120)
        diff = box.diff()
    finally:
        box.close()
    times["commands_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    result = grade(task, diff, backend=backend, spec=spec)
    times["grade_s"] = time.perf_counter() - t2
    times["solved"] = float(result.resolved)
    times["episode_s"] = time.perf_counter() - t0
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    tasks = load_tasks(args.tasks, split=args.split)[: args.episodes]
    backend = LocalBackend(max_concurrent=args.slots)
    spec = SandboxSpec()
    backend.check(spec)  # the namespace probe, outside the timings
    start = time.perf_counter()
    lost = 0
    rows = []
    with ThreadPoolExecutor(max_workers=len(tasks)) as pool:
        futures = [pool.submit(episode, t, backend, spec) for t in tasks]
        for f in futures:
            try:
                rows.append(f.result())
            except Exception as err:  # a lost episode
                lost += 1
                print(f"lost: {type(err).__name__}: {err}")
    wall = time.perf_counter() - start
    report: dict[str, object] = {
        "episodes": len(tasks),
        "slots": args.slots,
        "cpus": os.cpu_count(),
        "lost": lost,
        "solved": sum(int(r["solved"]) for r in rows),
        "wall_s": round(wall, 2),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    for key in ("create_s", "commands_s", "grade_s", "episode_s"):
        values = [r[key] for r in rows]
        if values:
            report[key] = {"mean": round(statistics.mean(values), 3), "max": round(max(values), 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
