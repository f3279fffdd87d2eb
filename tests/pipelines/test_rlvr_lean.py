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
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6, "chunk_size": 8},
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
        assert a["actor/pg_loss"] == b["actor/pg_loss"]
    a = load_file(str(runs / "rl-auto" / "final" / "model.safetensors"))
    b = load_file(str(runs / "rl-recompute" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
