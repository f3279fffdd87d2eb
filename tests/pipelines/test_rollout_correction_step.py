"""`algorithm.rollout_correction` in the RL iteration: the driver puts the weights and the
rejection into the batch, the `rl` objective applies them, and the old log-probs it needs are
always computed (hand-computed numbers)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from roll_core.config import load_recipe
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.pipelines.rl_iteration import (
    correct_rollout,
    mini_batch_meta,
    reuses_update_log_probs,
)
from roll_core.workers.objectives import rl

ROOT = Path(__file__).resolve().parents[2]
HALF = math.log(0.5)


def _batch() -> Batch:
    """2 rows, 3 input tokens, 2 target positions; the trainer's log-probs are log(0.5) (the
    logits below are uniform over 2 tokens); the sampler's make the token ratios
    pi_old / pi_rollout = [[2, 0.5], [4, 1]]."""
    rho = torch.tensor([[2.0, 0.5], [4.0, 1.0]])
    old = torch.full((2, 2), HALF)
    return Batch(
        tensors={
            "input_ids": torch.tensor([[0, 1, 0], [0, 0, 1]]),
            "response_mask": torch.ones(2, 2),
            "advantages": torch.ones(2, 2),
            "old_log_probs": old,
            "behaviour_log_probs": old - torch.log(rho),
        }
    )


def _objective_loss(batch: Batch, algo: AlgorithmConfig) -> float:
    batch.meta = mini_batch_meta(batch, max_response_length=2)
    logits = torch.zeros(2, 3, 2, requires_grad=True)  # uniform: every log-prob is log(0.5)
    loss, _ = rl(logits, batch, algorithm=algo)
    loss.backward()
    return float(loss.detach())


def test_token_mis_reaches_the_loss() -> None:
    algo = AlgorithmConfig.model_validate(
        {"preset": "grpo", "kl": {"coef": 0.0}, "rollout_correction": {"preset": "token_mis"}}
    )
    batch = _batch()
    metrics = correct_rollout(batch, algo)
    # token MIS (band [0, 2]): the ratio 4 is rejected; the rest keep their untruncated ratio
    assert batch.tensors["response_mask"].tolist() == [[1.0, 1.0], [0.0, 1.0]]
    assert torch.allclose(batch.tensors["rollout_is_weights"], torch.tensor([[2, 0.5], [4, 1.0]]))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    # ppo with ratio 1 and A = 1: token loss -w; grpo's seq-mean-token-mean over the kept
    # tokens: row 0 -(2 + 0.5) / 2 = -1.25, row 1 (its one kept token) -1 -> mean -1.125
    assert _objective_loss(batch, algo) == pytest.approx(-1.125, rel=1e-5)


def test_without_correction_the_batch_is_untouched() -> None:
    algo = AlgorithmConfig.model_validate({"preset": "grpo", "kl": {"coef": 0.0}})
    batch = _batch()
    assert correct_rollout(batch, algo) == {}
    assert "rollout_is_weights" not in batch.tensors
    assert _objective_loss(batch, algo) == pytest.approx(-1.0, rel=1e-5)


def test_correction_needs_the_old_log_probs_before_the_update(tmp_path: Path) -> None:
    recipe = ROOT / "recipes" / "tiny-arith-rlvr.yaml"
    base = [f"runs_dir={tmp_path}", "trainer.ppo_epochs=1", "trainer.mini_batches=1"]
    base += ["algorithm.kl.coef=0.0"]
    assert reuses_update_log_probs(load_recipe(recipe, base, expected="rlvr"))
    on = load_recipe(recipe, [*base, "algorithm.rollout_correction.preset=geo_rs"], expected="rlvr")
    assert not reuses_update_log_probs(on)
    # tis_cap is the rollout correction's token TIS: the same old-log-prob pass
    alias = load_recipe(recipe, [*base, "algorithm.tis_cap=2"], expected="rlvr")
    assert not reuses_update_log_probs(alias)


def test_rlvr_corrects_after_the_advantages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A rejected last token must not drop its response's score (placed on the last response
    token) from the group baseline, so the rejection comes after the advantages."""
    import yaml

    from roll_core.pipelines import launch, rl_loop

    calls: list[str] = []
    for name in ("advantages_and_kl", "correct_rollout"):
        original = getattr(rl_loop, name)

        def record(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(rl_loop, name, record)
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 8},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 3},
        "algorithm": {"preset": "grpo", "rollout_correction": {"preset": "token_mis"}},
        "trainer": {"max_steps": 1, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1},
        "actor_infer": {"num_threads": 1},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    launch(load_recipe(path, []), recipe=str(path), run_id="order")
    assert calls == ["advantages_and_kl", "correct_rollout"]
