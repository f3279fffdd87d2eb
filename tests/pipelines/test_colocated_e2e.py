"""Colocated roles taking turns, end to end through the real CLI on the tiny model (CPU).

With every offload switch on, actor_train's optimizer state, gradients and parameters and
actor_infer's weights leave their storage between turns (backup, resize to 0, back: see
roll_core/backends/offload.py) every step, checkpoints included; the run must log the phase
metrics and give exactly the losses of the same run with nothing moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

RECIPE = {
    "pipeline": "rlvr",
    "name": "tiny-colocated",
    "model": {"path": "builtin:tiny-qwen3"},
    "data": {
        "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
        "max_prompt_length": 64,
    },
    # fixed batches: the two runs below must generate the same responses
    "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 4, "deterministic": True},
    "algorithm": {"preset": "grpo"},
    "trainer": {"max_steps": 3, "micro_batch_size": 8},
    "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
    "actor_infer": {"num_threads": 1},
    "checkpoint": {"every_steps": 2},
    "tracking": {"backends": ["console", "jsonl"], "time_split_every": 1},
}
ON = [
    "actor_train.offload.optimizer=true",
    "actor_train.offload.grads=true",
    "actor_train.offload.params=true",
    "actor_infer.offload.weights=true",
    "actor_infer.offload.kv_cache=true",
]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_offload_every_step_changes_nothing_but_logs_the_phases(roll, tmp_path: Path) -> None:
    recipe = tmp_path / "rl.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "runs_dir": str(tmp_path / "runs")}))
    plain = roll("train", "rlvr", str(recipe), "--run-id", "plain")
    assert plain.returncode == 0, plain.stderr
    moved = roll("train", "rlvr", str(recipe), *ON, "--run-id", "moved")
    assert moved.returncode == 0, moved.stderr
    a, b = rows(tmp_path / "runs" / "plain"), rows(tmp_path / "runs" / "moved")
    steps = [r for r in b if "actor/pg_loss" in r]
    assert len(steps) == 3
    for key in ("actor/pg_loss", "train/grad_norm", "rollout/reward_mean"):
        assert [r[key] for r in a if key in r] == [r[key] for r in steps], key
    for r in steps:
        # bytes moved off are the bytes moved back: tiny-qwen3 fp32, weights on both roles
        assert r["offload/actor_train_bytes"] > 0 and r["offload/actor_infer_bytes"] > 0
        assert r["reload/actor_train_bytes"] > 0 and r["reload/actor_infer_bytes"] > 0
        assert r["time/offload"] > 0 and r["time/reload"] > 0
        # process RSS measured inside the workers after each phase (one process: local)
        for key in (
            "after_generate/actor_train",
            "after_generate/actor_infer",
            "after_infer_offload/actor_infer",
            "after_train_reload/actor_train",
            "after_update/actor_train",
            "after_train_offload/actor_train",
            "after_infer_reload/actor_infer",
        ):
            assert 0 < r[f"memory/{key}_rss_gb"] < 64, key
    # the optimizer's moments (2 x params) + params moved off actor_train; weights off infer
    assert steps[1]["offload/actor_train_bytes"] > 2 * steps[1]["offload/actor_infer_bytes"]
    assert not any(k.startswith(("offload/", "time/offload")) for r in a for k in r)
    assert "offload" in moved.stderr  # the console's time split shows the moves
    # the checkpoint at step 2 and the export were written with the state back in place
    assert (tmp_path / "runs" / "moved" / "final" / "model.safetensors").exists()
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "runs" / "plain" / "final" / "model.safetensors"))
    wb = load_file(str(tmp_path / "runs" / "moved" / "final" / "model.safetensors"))
    assert all(wa[k].equal(wb[k]) for k in wa)
