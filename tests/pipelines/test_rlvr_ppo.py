"""PPO (the `ppo` preset: GAE with a critic) through the real CLI on the tiny recipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_cli_env, make_roll

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny-arith-rlvr.yaml")


def small(tmp_path: Path, steps: int) -> list[str]:
    """Overrides that shrink the demo recipe to a few seconds on a random-init tiny model."""
    return [
        f"runs_dir={tmp_path / 'runs'}",
        "model.path=builtin:tiny-qwen3",
        "data.train.max_rows=128",
        "data.eval.max_rows=8",
        "rollout.n=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=4",
        "rollout.deterministic=true",  # fixed batches: the resume below is exact
        f"trainer.max_steps={steps}",
        "trainer.micro_batch_size=8",
        "trainer.mini_batches=2",
        "eval.every_steps=2",
        "checkpoint.every_steps=1",
        "actor_train.num_threads=1",
        "actor_infer.num_threads=1",
        "tracking.backends=[jsonl]",
        "algorithm.preset=ppo",
        "critic.num_threads=1",
        "critic.optim.lr=1e-3",
        "critic.optim.scheduler=constant",
    ]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


@pytest.fixture(scope="module")
def two_steps(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-step PPO run for the module: the preset test reads it, the resume test resumes a
    copy of it (the same run was launched once by each)."""
    directory = tmp_path_factory.mktemp("ppo")
    roll = make_roll(make_cli_env(cache_dir))
    res = roll("train", "rlvr", RECIPE, *small(directory, 2), "--run-id", "ppo-b")
    assert res.returncode == 0, res.stderr
    return directory / "runs" / "ppo-b"


def test_ppo_preset_trains_actor_and_critic(two_steps: Path) -> None:
    run = two_steps
    logged = rows(run)
    assert [r["step"] for r in logged] == [0, 1, 2]
    for r in logged[1:]:
        for key in (
            "critic/value_loss",
            "critic/vf_clipfrac",
            "critic/values_mean",
            "critic/explained_variance",
            "critic/grad_norm",
            "actor/pg_loss",
            "actor/reward_kl",  # the ppo preset's KL penalty in the reward
            "time/values",
        ):
            assert key in r and r[key] == r[key], key  # present and not NaN
    assert logged[1]["critic/values_mean"] == 0.0  # the value head starts at zero
    assert logged[1]["critic/lr"] == pytest.approx(1e-3)
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "critic" / "rank-0" / "value_model.safetensors").exists()
    assert (ckpt / "critic" / "rank-0" / "optimizer.pt").exists()
    config = (run / "config.yaml").read_text()
    assert "adv_estimator: gae" in config and "critic:" in config


@pytest.mark.slow
def test_ppo_resume_is_exact(roll, two_steps: Path, tmp_path: Path) -> None:
    """3 steps straight == 2 steps, then `roll resume` to 3: actor and critic bit for bit."""
    straight = roll("train", "rlvr", RECIPE, *small(tmp_path, 3), "--run-id", "ppo-a")
    assert straight.returncode == 0, straight.stderr
    shutil.copytree(two_steps, tmp_path / "runs" / "ppo-b")  # the 2-step run, resumed here
    resumed = roll("resume", "ppo-b", "trainer.max_steps=3", "--runs-dir", str(tmp_path / "runs"))
    assert resumed.returncode == 0, resumed.stderr
    a, b = tmp_path / "runs" / "ppo-a", tmp_path / "runs" / "ppo-b"
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    for key in ("critic/value_loss", "critic/values_mean", "actor/pg_loss", "rollout/reward_mean"):
        assert ra[3][key] == rb[3][key], key
    for part in (
        "critic/rank-0/value_model.safetensors",
        "actor_train/rank-0/model/model.safetensors",
    ):
        wa = load_file(str(a / "checkpoints" / "step-000003" / part))
        wb = load_file(str(b / "checkpoints" / "step-000003" / part))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), part


def test_gae_without_a_critic_section_is_a_recipe_error(roll, tmp_path: Path) -> None:
    res = roll(
        "train",
        "rlvr",
        RECIPE,
        "model.path=builtin:tiny-qwen3",
        "algorithm.preset=ppo",
        "--dry-run",
    )
    assert res.returncode == 2, res.stderr
    assert "critic:" in res.stderr and "Traceback" not in res.stderr


def test_dry_run_plans_a_critic_role_for_ppo(roll) -> None:
    res = roll(
        "train",
        "rlvr",
        RECIPE,
        "model.path=builtin:tiny-qwen3",
        "algorithm.preset=ppo",
        "critic={}",
        "--dry-run",
    )
    assert res.returncode == 0, res.stderr
    assert "Critic" in res.stdout + res.stderr
