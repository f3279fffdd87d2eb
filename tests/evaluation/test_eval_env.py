"""`roll eval MODEL --env NAME`: a model's recorded episodes in an env and their summary
(roll_core/evaluation/envs.py), the run's own env options, and the CLI's choice of mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.envs.play import read_episodes
from roll_core.errors import ConfigError
from roll_core.evaluation.envs import evaluate_env, run_env_options
from roll_core.evaluation.models import ResolvedModel


def test_a_models_episodes_are_recorded_and_summarised(tmp_path: Path) -> None:
    out = tmp_path / "fl.jsonl"
    result = evaluate_env(
        "builtin:tiny-qwen3-8k", "frozen_lake", {"size": 4}, episodes=2, seed=5, out=str(out)
    )
    episodes = read_episodes(out, env="frozen_lake")
    assert [e.seed for e in episodes] == [5, 6] and {e.policy for e in episodes} == {"model"}
    m = result.metrics
    assert m["episodes"] == 2
    assert m["success_rate"] == sum(e.success for e in episodes) / 2
    assert m["mean_length"] == sum(len(e.turns) for e in episodes) / 2
    summary = json.loads(result.summary.read_text())
    assert summary["options"] == {"size": 4} and summary["seed_start"] == 5
    assert summary["metrics"] == m


def test_a_runs_env_options_and_eval_options_are_the_defaults() -> None:
    config = {
        "envs": [
            {"env": "sokoban", "options": {"width": 6}},
            {"env": "swe", "options": {"tasks": "data/swe", "split": "train"},
             "eval_options": {"split": "test"}},
        ]
    }  # fmt: skip
    model = ResolvedModel("builtin:tiny-qwen3", "run x", None, config)
    assert run_env_options(model, "swe") == {"tasks": "data/swe", "split": "test"}
    assert run_env_options(model, "frozen_lake") == {}


def test_a_bad_env_option_fails_before_a_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sizee"):
        evaluate_env("builtin:tiny-qwen3", "frozen_lake", {"sizee": 4}, out=str(tmp_path / "x"))


def test_the_cli_takes_data_or_env(roll, tmp_path: Path) -> None:
    res = roll("eval", "builtin:tiny-qwen3")
    assert res.returncode == 2 and "--data DATASET" in res.stderr and "Traceback" not in res.stderr
    out = tmp_path / "e.jsonl"
    res = roll(
        "eval", "builtin:tiny-qwen3-8k", "--env", "frozen_lake", "--env-option", "size=4",
        "--episodes", "1", "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "success_rate" in res.stdout and out.exists()
