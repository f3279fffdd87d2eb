"""One plan per launch (roll_core/engine/plan.py): the placement and memory estimate
(`gpu_plan`), the colocated offload (`resolve_offload`) and the weight-sync path
(`planned_path`) are computed once, by `make_plan`, and read everywhere else."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import roll_core.engine.plan as plan_module
from roll_cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PLANNERS = ("gpu_plan", "resolve_offload", "planned_path")


def test_only_make_plan_calls_the_planners() -> None:
    """No module of roll_core or roll_cli but engine/plan.py calls a planner (so nothing can
    recompute a part of the plan and disagree with the rest)."""
    callers = []
    for path in sorted([*ROOT.glob("roll_core/**/*.py"), *ROOT.glob("roll_cli/**/*.py")]):
        if path == ROOT / "roll_core" / "engine" / "plan.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in PLANNERS:
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert callers == []


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    calls: Counter[str] = Counter()
    for name in PLANNERS:
        original = getattr(plan_module, name)

        def wrapped(*args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            calls[_name] += 1
            return _f(*args, **kw)

        monkeypatch.setattr(plan_module, name, wrapped)
    yield calls


def test_a_dry_run_plans_once(counted: Counter[str]) -> None:
    """`--dry-run` of a GPU recipe (placement, memory, colocation, sync rows and the memory
    warnings) makes the plan once."""
    res = CliRunner().invoke(
        app, ["train", "rlvr", str(ROOT / "recipes" / "qwen2.5-7b-rlvr.yaml"), "--dry-run"]
    )
    assert res.exit_code == 0, res.output
    assert "weight sync" in res.output and "memory/GPU" in res.output
    assert counted == Counter(dict.fromkeys(PLANNERS, 1))


@pytest.mark.slow
def test_a_run_plans_once(counted: Counter[str], tmp_path: Path) -> None:
    """A real one-step `roll train rlvr` (checks, roles, turns, weight sync): one plan."""
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 8},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 3},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "trainer": {"max_steps": 1, "micro_batch_size": 8},
        "checkpoint": {"export_final": False},
        "tracking": {"backends": ["jsonl"], "rollout_records": {"enabled": False}},
        "actor_train": {"num_threads": 1},
        "actor_infer": {"num_threads": 1},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(app, ["train", "rlvr", str(path)])
    assert res.exit_code == 0, res.output
    assert counted == Counter(dict.fromkeys(PLANNERS, 1))
