"""End-to-end `roll train agentic` through the real CLI on the tiny model (2 steps + resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, **sections: object) -> Path:
    data: dict = {
        "pipeline": "agentic",
        "name": "tiny-agentic-test",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [
            {
                "env": "frozen_lake",
                "options": {"size": 3, "max_steps": 3},
                "system_prompt": "Lake. Answer Up, Down, Left or Right.",
                "groups_per_step": 2,
                "eval_episodes": 2,
            },
            {
                "env": "sokoban",
                "options": {"width": 5, "height": 5, "max_steps": 2},
                "system_prompt": "Sokoban.",
                "groups_per_step": 1,
                "eval_episodes": 1,
            },
        ],
        "rollout": {"group_size": 2, "max_new_tokens": 6},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "warm_start": {"steps": 1, "episodes_per_step": 2, "lr": 5.0e-3},
        "trainer": {"max_steps": 2, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": 2},
        "checkpoint": {"every_steps": 1, "keep_last": 2},
        "tracking": {"backends": ["jsonl"]},
    }
    data.update(sections)
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_train_agentic_two_steps_mixed_envs(roll, tmp_path: Path) -> None:
    res = roll("train", "agentic", str(recipe(tmp_path)), "--run-id", "ag", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    run = tmp_path / "runs" / "ag"
    logged = rows(run)
    steps = [r for r in logged if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    first = steps[0]
    for key in (
        "rollout/success_rate",
        "rollout/episode_return",
        "rollout/episode_length",
        "rollout/invalid_action_rate",
        "rollout/env_errors",
        "rollout/env_timeouts",
        "rollout/tokens_per_trajectory",
        "rollout/turn_generate_s",
        "rollout/turn_env_s",
        "rollout/frozen_lake/success_rate",  # per env tag when envs are mixed
        "rollout/sokoban/invalid_action_rate",
        "actor/pg_loss",
        "train_infer/logprob_diff",
    ):
        assert key in first, key
    assert first["perf/samples"] == 2 * 2 + 1 * 2  # trajectory-wise: one row per episode
    assert first["train_infer/logprob_diff"] < 1e-3
    assert "eval/frozen_lake/success_rate" in steps[1]
    assert any("warm_start/loss_last" in r for r in logged)
    # warm_start.lr for the warm-up; RL's cosine schedule (over 2 steps) starts after it
    assert [r["warm_start/lr"] for r in logged if "warm_start/lr" in r] == [5.0e-3]
    assert [r["train/lr"] for r in steps] == [1.0e-3, 0.0]
    assert (run / "checkpoints" / "step-000002").is_dir()
    state = json.loads((run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["rollout"]["next_group_seed"] == {"frozen_lake": 4, "sokoban": 2}
    # the console: the start-up line, the warm start as a counted phase, the key metric
    assert "envs: frozen_lake (2 groups/step), sokoban (1 groups/step)" in res.stderr
    assert "warm start (SFT on random valid actions) (1): done in " in res.stderr
    meta = json.loads((run / "meta.json").read_text())
    assert "eval/success_rate" in meta["metrics"] and "rollout/success_rate" in meta["metrics"]
    # the weight-sync path the run took (local executor, torch + hf): console and meta.json
    assert meta["weight_sync"]["path"] == "same_process"
    assert "weight sync: same_process (the engine reads the trainer's parameters" in res.stderr


@pytest.mark.slow
def test_killed_run_resumes_with_the_next_env_seeds_bit_for_bit(roll, tmp_path: Path) -> None:
    # deterministic mode, one request per call: a turn's response never depends on what else
    # was in flight, so a run killed while saving step 2 and resumed from step 1 ends with the
    # weights of the run that never stopped (docs/runs.md "What a resume reproduces")
    path = recipe(
        tmp_path,
        envs=[
            {
                "env": "frozen_lake",
                "options": {"size": 3, "max_steps": 2},
                "system_prompt": "Lake.",
                "groups_per_step": 1,
                "eval_episodes": 1,
            }
        ],
        rollout={"group_size": 2, "max_new_tokens": 6, "deterministic": True, "chunk_size": 1},
        warm_start={"steps": 0},
        trainer={"max_steps": 3, "micro_batch_size": 8},
    )
    res = roll("train", "agentic", str(path), "--run-id", "straight", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    kill = {"ROLL_DEBUG_KILL_IN_SAVE": "2"}
    res = roll("train", "agentic", str(path), "--run-id", "ag", timeout=240, env=kill)
    assert res.returncode != 0
    res = roll("resume", "ag", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr + res.stdout
    run = tmp_path / "runs" / "ag"
    assert [r["step"] for r in rows(run) if r["step"] > 0][-2:] == [2, 3]
    state = json.loads((run / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert state["rollout"]["next_group_seed"] == {"frozen_lake": 3}
    a = load_file(str(tmp_path / "runs" / "straight" / "final" / "model.safetensors"))
    b = load_file(str(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dry_run_of_every_agentic_recipe(roll) -> None:
    for name in (
        "tiny-frozenlake",
        "tiny-sokoban",
        "qwen2.5-0.5b-sokoban",
        "qwen3-4b-sokoban-gigpo",
    ):
        res = roll("train", "agentic", str(ROOT / "recipes" / f"{name}.yaml"), "--dry-run")
        assert res.returncode == 0, name + res.stderr
        assert "recipe is valid" in res.stdout


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"envs": [{"env": "sokobn"}]}, "Did you mean 'sokoban'"),
        ({"envs": [{"env": "sokoban", "options": {"widht": 6}}]}, "unknown option 'widht'"),
    ],
)
def test_bad_env_is_a_clear_error(roll, tmp_path: Path, sections: dict, message: str) -> None:
    res = roll("train", "agentic", str(recipe(tmp_path, **sections)))
    assert res.returncode != 0
    assert message in res.stderr + res.stdout
    assert "Traceback" not in res.stderr
