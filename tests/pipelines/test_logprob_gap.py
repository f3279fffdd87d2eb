"""The train/infer log-prob gap (issue 32, item 5): `train_infer/logprob_diff_max` reaches the
logged metrics when the update's own forward measures the gap (micro-batches and ranks combine
a maximum by max), and a gap above `trainer.warn_logprob_diff` is warned about once."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roll_core.backends.train.base import add_metrics
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.engine.dispatch import reduce_rank_metrics
from roll_core.pipelines.rl_iteration import RLState, logprob_gap_warning, warn_logprob_gap
from roll_core.workers.objectives import rl

HALF = math.log(0.5)  # every target's log-prob under all-zero logits over a 2-token vocabulary


def micro_batch(behaviour: list[float], mask: list[int]) -> Batch:
    """One row of 3 input ids (2 target positions), all-zero advantages, global meta of the
    whole mini-batch below (3 response tokens in 2 sequences)."""
    batch = Batch(
        {
            "input_ids": torch.tensor([[0, 1, 0]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.long),
            "response_mask": torch.tensor([mask], dtype=torch.float32),
            "advantages": torch.zeros(1, 2),
            "behaviour_log_probs": torch.tensor([behaviour]),
        }
    )
    batch.meta = {"max_response_length": 2, "response_tokens": 3, "sequences": 2}
    return batch


def test_the_update_forward_reports_the_gap_max_across_micro_batches() -> None:
    algo = AlgorithmConfig()
    logits = torch.zeros(1, 3, 2)
    # gaps |logp_train - logp_infer|: row 0: 0 and 0.1; row 1: 0.3 (its 2nd position is masked)
    rows = [micro_batch([HALF, HALF + 0.1], [1, 1]), micro_batch([HALF - 0.3, 5.0], [1, 0])]
    sums: dict[str, float] = {}
    per_mb = []
    for mb in rows:
        _, metrics = rl(logits, mb, algorithm=algo)
        per_mb.append(metrics)
        add_metrics(sums, metrics)
    # row 0: mean 0.05 with share 2/3; row 1: 0.3 with share 1/3; the maximum is not weighted
    assert per_mb[0]["train_infer/logprob_diff_max"] == pytest.approx(0.1, abs=1e-6)
    assert per_mb[1]["train_infer/logprob_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert sums["train_infer/logprob_diff"] == pytest.approx((0 + 0.1 + 0.3) / 3, abs=1e-6)
    assert sums["train_infer/logprob_diff_max"] == pytest.approx(0.3, abs=1e-6)
    ranks = reduce_rank_metrics([sums, {**sums, "train_infer/logprob_diff_max": 0.7}])
    assert ranks["train_infer/logprob_diff_max"] == 0.7  # the largest rank's, not a sum


def test_gap_warning_threshold_and_text() -> None:
    assert logprob_gap_warning({"train_infer/logprob_diff": 2e-7}, 5e-3) is None
    assert logprob_gap_warning({"train_infer/logprob_diff": 0.012}, None) is None
    assert logprob_gap_warning({"rollout/reward_mean": 1.0}, 5e-3) is None
    text = logprob_gap_warning(
        {"train_infer/logprob_diff": 0.0123, "train_infer/logprob_diff_max": 0.41}, 5e-3
    )
    assert text is not None
    for part in ("0.0123", "max 0.41", "0.005", "mixture-of-experts", "tis_cap", "decoupled_ppo"):
        assert part in text, part


def test_gap_warning_is_shown_once_per_run() -> None:
    printed: list[str] = []
    loop = SimpleNamespace(console=SimpleNamespace(print=lambda m, **_: printed.append(m)))
    state = RLState(AlgorithmConfig())
    warn_logprob_gap(loop, state, {"train_infer/logprob_diff": 1e-7}, 5e-3)
    assert printed == []
    for gap in (0.02, 0.03):
        warn_logprob_gap(loop, state, {"train_infer/logprob_diff": gap}, 5e-3)
    assert len(printed) == 1 and "0.02" in printed[0]
