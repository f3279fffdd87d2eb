"""The agentic async benchmark runs end to end (real `roll train agentic` per arm, on the
FrozenLake task) and prints one row per arm with a speedup and its held-out success; its
numbers are not asserted (timings belong in benchmarks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def speed_rows(stdout: str) -> dict[str, tuple[str, ...]]:
    """The speed table: arm -> (episodes/s, run/trained, speedup)."""
    return {
        m.group(1): m.groups()[1:]
        for m in re.finditer(
            r"^(sync|async-redundant)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+([\d.]+)"
            r"\s+([\d.]+)x$",
            stdout,
            re.M,
        )
    }


@pytest.mark.parametrize("task", ["coin", "frozenlake"])
def test_every_arm_recipe_validates(
    task: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each arm's recipe of both tasks is a valid recipe (the run below covers one task)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.agentic_async import ARMS, recipe
    from roll_core.config import load_recipe

    for arm in ARMS:
        cfg = load_recipe(recipe(tmp_path, arm, 3, 0.002, task, 2, 16), [])
        assert cfg.trainer.max_steps == 3 and cfg.name == f"bench-agentic-{task}-{arm}"


def success_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The held-out success table of `--task frozenlake`: arm -> (after warm start, at end)."""
    return {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(r"^(sync|async-redundant)\s+([\d.]+)%\s+([\d.]+)%$", stdout, re.M)
    }


@pytest.mark.slow
@pytest.mark.extended  # a benchmark's table; every arm's recipe is validated by default
def test_agentic_benchmark_on_frozenlake_prints_success_per_arm() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/agentic_async.py",
            "--task",
            "frozenlake",
            "--steps",
            "3",
            # 1 warm-start step and 4 held-out maps: the assertions read the tables' rows and
            # episode ratios, not the success rates (fewer steps than 3 the script refuses)
            "--warm-start-steps",
            "1",
            "--eval-episodes",
            "4",
            "--arms",
            "sync,async-redundant",
            "--latency-scale",
            "0.002",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = success_rows(res.stdout)
    assert set(rows) == {"sync", "async-redundant"}, res.stdout
    assert "held-out success after warm start" in res.stdout
    speed = speed_rows(res.stdout)
    assert set(speed) == {"sync", "async-redundant"}, res.stdout
    assert speed["sync"][2] == "1.00"  # the baseline's own ratio
    assert float(speed["sync"][1]) == 1.0  # lockstep runs exactly the episodes it trains
    assert float(speed["async-redundant"][1]) > 1.0  # redundancy runs extra episodes
