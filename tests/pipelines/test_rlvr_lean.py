"""The lean RL step (issue 22): the old-log-prob pass a one-update step skips must change
nothing, and the recipes a port from another trainer needs (raw prompts, a tokenizer-only
directory) run end to end. Real `roll` CLI on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, name: str = "rl.yaml", **sections: object) -> Path:
    base: dict = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
            "max_prompt_length": 64,
        },
        # fixed batches: runs of one recipe generate the same responses (bitwise comparisons)
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6, "deterministic": True},
        "algorithm": {"preset": "grpo"},
        "trainer": {"max_steps": 3, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }
    base.update(sections)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_skipped_old_log_prob_pass_gives_bit_identical_weights(roll, tmp_path: Path) -> None:
    """`auto` (the update's own detached log-probs) against `recompute` (a separate forward
    pass): 3 steps of 16 samples, micro-batches of 8 (two per update), the same bytes after."""
    path = recipe(tmp_path)
    for mode in ("auto", "recompute"):
        res = roll(
            "train", "rlvr", str(path), f"trainer.old_log_probs={mode}", "--run-id", f"rl-{mode}"
        )
        assert res.returncode == 0, res.stderr
    runs = tmp_path / "runs"
    skipped, full = rows(runs / "rl-auto"), rows(runs / "rl-recompute")
    assert all("time/old_log_prob" not in r for r in skipped)
    assert all("time/old_log_prob" in r for r in full[1:])
    for a, b in zip(skipped[1:], full[1:], strict=True):  # the gap is still logged, same value
        assert a["train_infer/logprob_diff"] == pytest.approx(b["train_infer/logprob_diff"])
        assert a["train_infer/logprob_diff_max"] == pytest.approx(
            b["train_infer/logprob_diff_max"]
        )  # the largest gap of any micro-batch (issue 32: was missing when the pass is skipped)
        assert a["actor/pg_loss"] == b["actor/pg_loss"]
    a = load_file(str(runs / "rl-auto" / "final" / "model.safetensors"))
    b = load_file(str(runs / "rl-recompute" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def bare_tokenizer(tmp_path: Path) -> Path:
    """The built-in tokenizer saved on its own (no config.json, no weights), without a chat
    template: what a base model's tokenizer looks like."""
    from roll_core.models.tokenizer import build_tokenizer, save_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    out = tmp_path / "bare-tokenizer"
    save_tokenizer(tok, out)
    assert not (out / "config.json").exists() and not (out / "chat_template.jinja").exists()
    return out


def test_validate_catches_a_missing_chat_template(roll, tmp_path: Path, bare_tokenizer) -> None:
    path = recipe(tmp_path, model={"path": "builtin:tiny-qwen3", "tokenizer": str(bare_tokenizer)})
    for command in (["validate", str(path)], ["train", "rlvr", str(path), "--dry-run"]):
        res = roll(*command)
        assert res.returncode == 2, res.stdout
        assert "has no chat template" in res.stderr and "data.chat_template: none" in res.stderr
        assert "Traceback" not in res.stderr
    res = roll("validate", str(path), "data.chat_template=missing/template.jinja")
    assert res.returncode == 2 and "no template file" in res.stderr
    res = roll("validate", str(path), "data.chat_template=none")
    assert res.returncode == 0, res.stderr


def test_raw_prompts_with_a_tokenizer_only_directory_train(
    roll, cli_env, monkeypatch, tmp_path: Path, bare_tokenizer
) -> None:
    path = recipe(
        tmp_path,
        model={"path": "builtin:tiny-qwen3", "tokenizer": str(bare_tokenizer)},
        data={
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
            "eval": {"path": str(ROOT / "data/tiny-arith/test.jsonl"), "max_rows": 8},
            "max_prompt_length": 64,
            "chat_template": "none",
        },
        trainer={"max_steps": 2, "micro_batch_size": 16},
        # validation scored by its own reward: a format check any text passes (training: math)
        eval={
            "every_steps": 2,
            "reward": {"domains": {"math": {"rewards": [{"name": "format", "pattern": ".*"}]}}},
        },
    )
    res = roll("train", "rlvr", str(path), "--run-id", "rl-raw")
    assert res.returncode == 0, res.stderr
    logged = rows(tmp_path / "runs" / "rl-raw")
    assert [r["step"] for r in logged if "actor/pg_loss" in r] == [1, 2]
    evals = [r for r in logged if "eval/reward_mean" in r]
    assert len(evals) == 2 and all(r["eval/reward_mean"] == 1.0 for r in evals)
    assert any(r["rollout/reward_mean"] < 1.0 for r in logged if "rollout/reward_mean" in r)
    # the prompts are the raw text: with the byte-level tokenizer, token ids == bytes
    from roll_core.config import load_recipe
    from roll_core.pipelines.rlvr import prepare

    monkeypatch.setenv("ROLL_CACHE_DIR", cli_env["ROLL_CACHE_DIR"])
    setup = prepare(load_recipe(path, [], expected="rlvr"))
    first = setup.train[0]
    assert first.prompt_ids == list(first.row["prompt"].encode())
