"""Async RLVR through the real CLI on the tiny model: ratio 0 is exactly the synchronous
pipeline; ratio 1 with partial rollout runs, logs the off-policy metrics, and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rl_recipe(tmp_path: Path):
    def make(**rollout: object) -> Path:
        import yaml

        recipe = {
            "pipeline": "rlvr",
            "name": "tiny-async-test",
            "runs_dir": str(tmp_path / "runs"),
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {
                "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 128},
                "max_prompt_length": 64,
            },
            "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 6, **rollout},
            "algorithm": {"preset": "grpo", "policy_loss": "decoupled_ppo"},
            "trainer": {"max_steps": 2, "micro_batch_size": 8},
            "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
            "actor_infer": {"num_threads": 1},
            "checkpoint": {"every_steps": 2, "keep_last": 3},
            "tracking": {"backends": ["jsonl"]},
        }  # fmt: skip
        path = tmp_path / "rl.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return make


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def numbers(run: Path) -> list[dict]:
    """Every logged value that does not measure time. `rollout/rewards_before_last_gen` counts
    rewards that finished while generation was still running (queue-scheduling overlap) and
    `rollout/gen_idle_fraction` is a share of wall time: both depend on thread timing, not on
    what was computed, so they are time measures too."""
    skip = ("time", "perf/", "wall", "_s", "seconds", "before_last_gen", "idle_fraction")
    return [{k: v for k, v in r.items() if not any(s in k for s in skip)} for r in rows(run)]


def test_explicit_ratio_zero_is_the_synchronous_pipeline_bit_for_bit(
    roll, rl_recipe, tmp_path: Path
) -> None:
    # the recipe's default and an explicit ratio 0 are the same synchronous scheduler; two
    # deterministic runs end bit for bit the same
    path = rl_recipe(deterministic=True)  # fixed batches: bit-exact
    assert roll("train", "rlvr", str(path), "--run-id", "sync").returncode == 0
    res = roll("train", "rlvr", str(path), "--run-id", "ratio0", "rollout.async_generation_ratio=0")
    assert res.returncode == 0, res.stderr
    runs = tmp_path / "runs"
    assert numbers(runs / "sync") == numbers(runs / "ratio0")
    a = load_file(runs / "sync" / "final" / "model.safetensors")
    b = load_file(runs / "ratio0" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_ratio_one_partial_rollout_runs_and_resumes(roll, rl_recipe, tmp_path: Path) -> None:
    path = rl_recipe(async_generation_ratio=1, partial_rollout=True)
    res = roll("train", "rlvr", str(path), "--run-id", "async")
    assert res.returncode == 0, res.stderr
    logged = [r for r in rows(tmp_path / "runs" / "async") if "perf/step_s" in r]
    assert len(logged) == 2
    for r in logged:
        assert r["rollout/samples_generated"] >= 0
        assert r["async/staleness_max"] <= 1  # the freshness bound
        for key in ("async/dropped_stale", "async/staleness_hist/0", "async/staleness_hist/1",
                    "actor/behav_weight_mean", "actor/clipfrac", "async/sync_pause_s",
                    "rollout/gen_idle_fraction"):  # fmt: skip
            assert key in r, key
    # resume from the step-2 checkpoint: the groups not yet trained on are regenerated
    res = roll("resume", "async", "--runs-dir", str(tmp_path / "runs"), "trainer.max_steps=3")
    assert res.returncode == 0, res.stderr + res.stdout
    assert [r["step"] for r in rows(tmp_path / "runs" / "async") if "perf/step_s" in r][-1] == 3


def test_async_recipe_errors_and_dry_run_plan(rl_recipe) -> None:
    """In process (no subprocess): the config errors and the plan's placement line."""
    from roll_core.config import load_recipe
    from roll_core.errors import ConfigError
    from roll_core.pipelines import plan

    with pytest.raises(ConfigError, match="only applies to async"):
        load_recipe(rl_recipe(partial_rollout=True))
    # the keys of the chunked / segmented path: what replaced them
    with pytest.raises(ConfigError, match="segment_tokens: removed: .* aborted and continued"):
        load_recipe(rl_recipe(segment_tokens=2))
    with pytest.raises(ConfigError, match="chunk_size only applies with rollout.deterministic"):
        load_recipe(rl_recipe(chunk_size=8))
    assert load_recipe(rl_recipe(deterministic=True, chunk_size=8)).rollout.chunk_size == 8
    with pytest.raises(ConfigError, match="fixed batches of rollout.deterministic"):
        load_recipe(rl_recipe(async_generation_ratio=1, partial_rollout=True, deterministic=True))
    with pytest.raises(ConfigError, match="async_generation_ratio"):
        load_recipe(rl_recipe(async_generation_ratio=-1))
    with pytest.raises(ConfigError, match="async_generation_ratio"):
        load_recipe(rl_recipe(async_generation_ratio="fast"))
    infer = {r.role: r.detail for r in plan(load_recipe(rl_recipe(async_generation_ratio=2)))}
    assert "async (ratio 2): disaggregated" in infer["actor_infer"]
    infer = {r.role: r.detail for r in plan(load_recipe(rl_recipe()))}
    assert "sync: colocated" in infer["actor_infer"]
    cfg = load_recipe(
        rl_recipe(async_generation_ratio=1),
        ["actor_train.device=cuda", "actor_infer.device=cuda"],
    )
    with pytest.raises(ConfigError, match="cannot overlap"):
        plan(cfg)
