"""data/tiny-code: generated files, reference solutions that pass, routing, the tiny recipe."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest

from roll_core.config.reward import RewardConfig
from roll_core.errors import DataError
from roll_core.rewards import RewardRouter
from roll_core.rewards.base import RewardSample

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "tiny-code"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_files_are_the_generators_output(tmp_path: Path) -> None:
    copy = tmp_path / "tiny-code"
    copy.mkdir()
    shutil.copy(DATA / "generate.py", copy / "generate.py")
    (tmp_path / "tiny-arith").symlink_to(ROOT / "data" / "tiny-arith")
    runpy.run_path(str(copy / "generate.py"), run_name="__main__")
    for name in ("train.jsonl", "test.jsonl", "mixed/train.jsonl", "mixed/test.jsonl"):
        assert (copy / name).read_bytes() == (DATA / name).read_bytes(), name


def test_reference_solutions_pass_and_wrong_ones_fail() -> None:
    cfg = RewardConfig.model_validate(
        {"domains": {"math": "math", "code": {"rewards": [{"name": "code"}]}}}
    )
    data = rows(DATA / "mixed" / "test.jsonl")[:8]  # 4 math, 4 code
    with RewardRouter.from_config(cfg, dataset_domains={"math", "code"}) as router:
        router.check_rows(data)
        good = router.score_many([RewardSample(r["prompt"], r["answer"], r) for r in data])
        bad = router.score_many(
            [RewardSample(r["prompt"], "```python\nprint(0)\n```", r) for r in data]
        )
        metrics = router.metrics()
    assert [g.score for g in good] == [1.0] * 8
    assert [b.score for b in bad if b.info.get("cases")] == [0.0] * 4
    assert metrics["reward/code/count"] == 8.0 and metrics["reward/math/count"] == 8.0
    assert metrics["reward/code/code/pass_rate"] == 0.5


def test_malformed_rows_fail_at_loading_with_the_row_named() -> None:
    cfg = RewardConfig.model_validate({"domains": {"math": "math", "code": "code"}})
    data = [
        {"prompt": "p", "answer": "1", "domain": "math"},
        {"prompt": "p", "answer": "x", "domain": "code", "tests": '["assert f(1) =="]'},
    ]
    match = r"row 1 \(domain 'code'\): test 0 is not valid"
    with RewardRouter.from_config(cfg) as router, pytest.raises(DataError, match=match):
        router.check_rows(data)


@pytest.mark.slow
def test_tiny_multidomain_recipe_runs(roll, tmp_path: Path) -> None:
    result = roll(
        "train",
        "rlvr",
        "recipes/tiny-multidomain-rlvr.yaml",
        "trainer.max_steps=1",
        "eval.every_steps=100",
        "checkpoint.every_steps=1",
        f"runs_dir={tmp_path}",
        "--run-id",
        "md",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(x) for x in (tmp_path / "md" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in lines if "reward/code/count" in m)
    assert step["reward/code/count"] > 0 and step["reward/math/count"] > 0
    assert step["reward/code/code/executions"] > 0  # every response ran in the sandbox
    assert step["reward/code/code/sandbox_errors"] == 0
