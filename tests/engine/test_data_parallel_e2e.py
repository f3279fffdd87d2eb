"""Data-parallel actor_train through the real CLI: RLVR on Ray with 2 train ranks (fsdp2)
and 1 inference rank, SFT with 2 local deepspeed ranks resuming bit for bit, and the sharded
backends evaluating exact match (greedy generation by every rank together)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


@pytest.mark.ray
def test_rlvr_two_train_ranks_one_infer_rank_on_ray(roll, tmp_path: Path) -> None:
    recipe = {
        "pipeline": "rlvr",
        "name": "dp-rl",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        "algorithm": {"preset": "grpo"},
        "trainer": {"max_steps": 2, "micro_batch_size": 4},
        "actor_train": {
            "backend": "fsdp2",
            "world_size": 2,
            "device": "cpu",
            "num_threads": 1,
            "optim": {"lr": 1.0e-3},
            # colocated on the host: the roles take turns, their state offloaded in between
            "offload": {"optimizer": True, "params": True},
        },
        "actor_infer": {"num_threads": 1, "device": "cpu", "offload": {"weights": True}},
        "checkpoint": {"every_steps": 2},
        "executor": {"type": "ray", "num_cpus": 4},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    res = roll("train", "rlvr", str(path), "--run-id", "dp-rl", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "runs" / "dp-rl"
    logged = rows(run)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        # the 2 train ranks computed the old log-probs of the 16 samples between them; the
        # inference rank got the gathered weights: both policies agree (fp32 on CPU)
        assert r["train_infer/logprob_diff"] < 1e-3
        assert math.isfinite(r["train/grad_norm"])  # one global norm, not a sum over ranks
        assert r["sync/bytes"] > 0
        # offload ran in the Ray actors, and each measured its own process's memory
        assert r["offload/actor_train_bytes"] > 0 and r["offload/actor_infer_bytes"] > 0
        assert r["memory/after_update/actor_train_rss_gb"] > 0
        assert r["memory/after_update/actor_infer_rss_gb"] > 0
        assert (
            r["memory/after_update/actor_train_rss_gb"]
            != r["memory/after_update/actor_infer_rss_gb"]
        )
    assert (run / "checkpoints" / "step-000002" / "actor_train" / "dcp" / ".metadata").exists()
    assert (run / "final" / "model.safetensors").exists()


@pytest.mark.extended  # DeepSpeed data parallel; bit-for-bit resume runs by default on torch
def test_sft_two_deepspeed_ranks_resume_bit_for_bit(roll, tiny_recipe, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    # 2 steps, stopped after the first: the resume restores Adam's moments, the data position
    # and the RNG after a real update (startup dominates each run; more steps add nothing)
    sections = {
        "trainer": {"max_steps": 2, "micro_batch_size": 4, "grad_accum_steps": 1},
        "actor_train": {
            "backend": "deepspeed",
            "world_size": 2,
            "device": "cpu",
            "num_threads": 1,
            "deepspeed": {"zero_stage": 2},
            "optim": {"lr": 1.0e-3, "scheduler": "constant"},
        },
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": 1, "keep_last": 2},
        "tracking": {"backends": ["jsonl"]},
    }
    straight = roll("sft", str(tiny_recipe(**sections)), "--run-id", "straight", timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    short = {**sections, "trainer": {**sections["trainer"], "max_steps": 1}}
    first = roll("sft", str(tiny_recipe(**short)), "--run-id", "split", timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    runs = tmp_path / "runs"
    assert (runs / "split" / "checkpoints" / "step-000001" / "actor_train" / "deepspeed").is_dir()
    again = roll("resume", "split", "--runs-dir", str(runs), "trainer.max_steps=2", timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    a = (runs / "straight" / "final" / "model.safetensors").read_bytes()
    b = (runs / "split" / "final" / "model.safetensors").read_bytes()
    assert a == b
    assert [r["train/loss"] for r in rows(runs / "straight")] == [
        r["train/loss"] for r in rows(runs / "split")
    ]


@pytest.mark.parametrize(
    "backend, options",
    [
        ("fsdp2", {}),
        pytest.param(  # extended: ZeRO-3 generation (fsdp2's runs by default)
            "deepspeed", {"deepspeed": {"zero_stage": 3}}, marks=pytest.mark.extended
        ),
    ],
    ids=["fsdp2", "deepspeed-zero3"],
)
def test_sharded_backends_evaluate_exact_match(
    roll, tiny_recipe, tmp_path: Path, backend: str, options: dict
) -> None:
    """eval.exact_match generates with the training model: both ranks of a sharded model run
    every forward together (each gathers weights) and the eval result is written."""
    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    recipe = tiny_recipe(
        data={
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 16},
            "eval": {"path": str(ROOT / "data/tiny-arith/test.jsonl"), "max_rows": 4},
            "max_length": 64,
        },
        trainer={"max_steps": 1, "micro_batch_size": 4, "grad_accum_steps": 1},
        actor_train={
            "backend": backend,
            "world_size": 2,
            "device": "cpu",
            "num_threads": 1,
            **options,
        },
        eval={"every_steps": 1, "exact_match": True, "batch_size": 4, "max_new_tokens": 3},
        checkpoint={"every_steps": None},
        tracking={"backends": ["jsonl"]},
    )
    res = roll("sft", str(recipe), "--run-id", "em", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (logged,) = rows(tmp_path / "runs" / "em")
    assert logged["step"] == 1
    assert 0.0 <= logged["eval/exact_match"] <= 1.0
    assert math.isfinite(logged["eval/loss"])
