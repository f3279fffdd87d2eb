"""End-to-end RLVR through the real CLI on the tiny model (random init, a few steps)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rl_recipe(tmp_path: Path):
    def make(**sections: object) -> Path:
        import yaml

        recipe = {
            "pipeline": "rlvr",
            "name": "tiny-rl-test",
            "runs_dir": str(tmp_path / "runs"),
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {
                "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 256},
                "eval": {"path": str(ROOT / "data/tiny-arith/test.jsonl"), "max_rows": 16},
                "max_prompt_length": 64,
            },
            "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6},
            "algorithm": {"preset": "grpo"},
            "trainer": {"max_steps": 6, "micro_batch_size": 8},
            "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
            "actor_infer": {"num_threads": 1},
            "eval": {"every_steps": 3},
            "checkpoint": {"every_steps": 2, "keep_last": 3},
            "tracking": {"backends": ["console", "jsonl"]},
        }
        recipe.update(sections)
        path = tmp_path / "rl.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return make


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_rlvr_runs_and_logs_the_promised_metrics(roll, rl_recipe, tmp_path: Path) -> None:
    res = roll("train", "rlvr", str(rl_recipe()), "--run-id", "rl-base-00")
    assert res.returncode == 0, res.stderr
    run = tmp_path / "runs" / "rl-base-00"
    logged = rows(run)
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4, 5, 6]
    step = logged[1]
    for key in (
        "rollout/reward_mean",
        "rollout/response_length_mean",
        "rollout/response_clip_ratio",
        "actor/pg_loss",
        "actor/clipfrac",
        "train/grad_norm",
        "time/rollout",
        "time/train",
        "sync/seconds",
        "perf/tokens_per_s",
    ):
        assert key in step, key
    # weights in sync: the trainer's log-probs equal the sampler's (hf, fp32)
    assert all(r["train_infer/logprob_diff"] < 1e-3 for r in logged[1:])
    assert "eval/accuracy" in logged[0] and "eval/accuracy" in logged[3]
    # the training reward counts training samples only (4 prompts x n=4 = 16 a step): the
    # 16 eval samples scored after steps 0 and 3 do not leak into steps 1 and 4 (32 before)
    assert [r["reward/math/count"] for r in logged[1:]] == [16.0] * 6
    assert (run / "final" / "model.safetensors").exists()
    # the sync path the run took (local executor, torch + hf: one model), not only the
    # dry run's plan: on the console at the start and in meta.json
    sync = json.loads((run / "meta.json").read_text())["weight_sync"]
    assert sync == {
        "path": "same_process",
        "requested": "auto",
        "backend": None,
        "ranks": 2,
        "bucket_mb": 256,
        "shared": True,
    }
    assert "weight sync: same_process (the engine reads the trainer's parameters" in res.stderr


def test_rlvr_rollout_correction_logs_its_metrics(roll, rl_recipe, tmp_path: Path) -> None:
    recipe = rl_recipe(
        # tis_cap is the alias of token TIS: it joins the geo_rs rejection in one section
        algorithm={"preset": "grpo", "tis_cap": 2.0, "rollout_correction": {"preset": "geo_rs"}},
        trainer={"max_steps": 2, "micro_batch_size": 8},
        eval={"every_steps": None},
    )
    res = roll("train", "rlvr", str(recipe), "--run-id", "rl-corr-00")
    assert res.returncode == 0, res.stderr
    resolved = yaml.safe_load((tmp_path / "runs" / "rl-corr-00" / "config.yaml").read_text())
    assert resolved["algorithm"]["tis_cap"] is None
    rc = resolved["algorithm"]["rollout_correction"]
    assert (rc["is_level"], rc["is_cap"], rc["rs_divergence"][0]["option"]) == (
        "token",
        2.0,
        "seq_mean_k1",
    )
    trained = [r for r in rows(tmp_path / "runs" / "rl-corr-00") if "actor/pg_loss" in r]
    assert len(trained) == 2
    for step in trained:
        for key in (
            "kl",
            "k3_kl",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
            "ess",
            "rollout_is_mean",
            "rollout_is_eff_sample_size",
            "rollout_rs_masked_fraction",
            "rollout_rs_seq_masked_fraction",
            "rollout_rs_seq_mean_k1_masked_fraction",
        ):
            assert f"rollout_corr/{key}" in step, key
        # hf sampler and trainer in fp32 with synced weights: (almost) no mismatch, so the
        # tight geometric band (ratio within 0.1%) keeps every response
        assert abs(step["rollout_corr/kl"]) < 1e-3
        assert step["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_rlvr_sigkill_resume_is_bitwise(roll, rl_recipe, cli_env, tmp_path: Path) -> None:
    # deterministic mode: fixed batch composition, so the resumed run is bit for bit the
    # uninterrupted one (docs/runs.md says what the streaming default guarantees instead)
    rollout = {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6}
    recipe = rl_recipe(rollout=rollout | {"deterministic": True, "chunk_size": 8})
    base = roll("train", "rlvr", str(recipe), "--run-id", "rl-base-01")
    assert base.returncode == 0, base.stderr
    run = tmp_path / "runs" / "rl-kill-02"
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "roll"),
            "train",
            "rlvr",
            str(recipe),
            "--run-id",
            "rl-kill-02",
        ],
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and any(r["step"] >= 3 for r in rows(run)):
            break
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = roll("resume", "rl-kill-02", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3, 4, 5, 6]
    a = load_file(str(tmp_path / "runs" / "rl-base-01" / "final" / "model.safetensors"))
    b = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_group_estimator_needs_groups(roll, rl_recipe) -> None:
    res = roll("train", "rlvr", str(rl_recipe()), "rollout.n=1")
    assert res.returncode == 2 and "rollout.n is 1" in res.stderr and "Traceback" not in res.stderr


def test_unknown_estimator_lists_valid(roll, rl_recipe) -> None:
    res = roll("train", "rlvr", str(rl_recipe()), "algorithm.adv_estimator=grpoo", "--dry-run")
    assert res.returncode == 2 and "grpo" in res.stderr and "Traceback" not in res.stderr


def test_rlvr_with_lora_syncs_merged_weights(roll, rl_recipe, tmp_path: Path) -> None:
    recipe = rl_recipe(trainer={"max_steps": 3, "micro_batch_size": 8}, eval={"every_steps": None})
    res = roll(
        "train",
        "rlvr",
        str(recipe),
        "actor_train.lora={rank: 4, alpha: 8}",
        "--run-id",
        "rl-lora-03",
    )
    assert res.returncode == 0, res.stderr
    logged = rows(tmp_path / "runs" / "rl-lora-03")
    # after each sync the sampler's log-probs equal the adapted trainer's: merged weights arrived
    assert all(
        r["train_infer/logprob_diff"] < 1e-3 for r in logged if "train_infer/logprob_diff" in r
    )
    assert len([r for r in logged if "train_infer/logprob_diff" in r]) == 3


def test_malformed_code_row_is_a_data_error_at_loading(roll, rl_recipe, tmp_path: Path) -> None:
    """A code row without test cases stops the run before any model work, naming the row."""
    data = tmp_path / "bad.jsonl"
    good = {"prompt": "1+1=", "answer": "2", "domain": "math"}
    bad = {"prompt": "write f", "answer": "def f(): pass", "domain": "code"}  # no "tests"
    data.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    recipe = rl_recipe(
        data={"train": {"path": str(data)}, "eval": {"path": str(data)}, "max_prompt_length": 64},
        reward={"domains": {"math": "math", "code": "code"}},
    )
    res = roll("train", "rlvr", str(recipe))
    assert res.returncode == 2, res.stderr
    assert "row 2" in res.stderr and "Traceback" not in res.stderr
