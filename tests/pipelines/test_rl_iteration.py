"""The RL iteration shared by rlvr and agentic (roll_core/pipelines/rl_iteration.py), on
hand-computed batches: advantages and KL from scores, the overlong penalty and filter, and the
global counts every micro-batch normalises its loss by."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import agg_loss
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.pipelines.rl_iteration import RLState, advantages_and_kl, mini_batch_meta


def _batch(scores: list[float], groups: list[int], lengths: list[int], width: int = 4) -> Batch:
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    return Batch(
        tensors={
            "scores": torch.tensor(scores),
            "group_ids": torch.tensor(groups),
            "response_lengths": torch.tensor(lengths),
            "response_mask": mask,
        },
        non_tensors={},
        meta={},
    )


def test_grpo_advantages_by_hand() -> None:
    # group 0 scores (1, 0): mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70711,
    #   A = +-0.5 / 0.70711 = +-0.70711 on every response token;
    # group 1 scores (1, 1): centred 0, so A = 0 (0 / (0 + eps)).
    algo = AlgorithmConfig.model_validate({"preset": "grpo", "kl": {"coef": 0.0}})
    batch = _batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [2, 3, 1, 2])
    metrics = advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=4)
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor(
        [[a, a, 0, 0], [-a, -a, -a, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32
    )
    assert torch.allclose(batch.tensors["advantages"], expected, atol=1e-5)
    # mean over the 8 response tokens: (2a - 3a) / 8 = -a / 8
    assert metrics["actor/advantage_mean"] == pytest.approx(-a / 8, abs=1e-5)
    assert metrics["actor/advantage_abs_max"] == pytest.approx(a, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_an_agent_episode_of_three_segments_counts_once_in_its_group(estimator: str) -> None:
    # one group, three episodes: A (return 1) in 3 segments (rows 0-2), B and C (return 0).
    # Per episode: scores (1, 0, 0), mean 1/3, unbiased std sqrt(1/3) = 0.57735:
    #   grpo A = (2/3) / 0.57735 = 1.1547, B = C = -0.57735;
    #   rloo A = 3/2 * 2/3 = 1, B = C = 3/2 * -1/3 = -0.5.
    # Per row (the old count, A weighing 3 times): mean 0.6, grpo A = 0.4 / 0.5477 = 0.7303.
    algo = AlgorithmConfig.model_validate({"preset": estimator, "kl": {"coef": 0.0}})
    batch = _batch([1.0, 1.0, 1.0, 0.0, 0.0], [0] * 5, [1, 2, 1, 2, 1])
    batch.tensors["episode_ids"] = torch.tensor([0, 0, 0, 1, 2])
    advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=4)
    a, b = (
        (2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)) if estimator == "grpo" else (1, -0.5)
    )
    expected = torch.tensor([[a, 0, 0, 0], [a, a, 0, 0], [a, 0, 0, 0], [b, b, 0, 0], [b, 0, 0, 0]])
    assert torch.allclose(batch.tensors["advantages"], expected, atol=1e-5)
    # without episode ids (env episodes: one row each) the rows are the samples, as before
    batch = _batch([1.0, 1.0, 1.0, 0.0, 0.0], [0] * 5, [1, 2, 1, 2, 1])
    advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=4)
    if estimator == "grpo":
        assert batch.tensors["advantages"][0, 0] == pytest.approx(0.4 / math.sqrt(0.3), abs=1e-5)


def test_overlong_penalty_and_reinforce_return_by_hand() -> None:
    # max_new_tokens 4, buffer 2: L_exp = 2. Lengths 1, 3, 4 get penalties 0,
    # (2 - 3) / 2 = -0.5 and (2 - 4) / 2 = -1. reinforce with gamma 1 and no baseline: every
    # response token's advantage is its row's shaped score (1 + 0, 1 - 0.5, 1 - 1).
    algo = AlgorithmConfig.model_validate(
        {
            "adv_estimator": "reinforce",
            "policy_loss": "pg",
            "overlong": {"mode": "penalty", "buffer_len": 2},
        }
    )
    batch = _batch([1.0, 1.0, 1.0], [0, 1, 2], [1, 3, 4])
    metrics = advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=4)
    expected = torch.tensor([[1, 0, 0, 0], [0.5, 0.5, 0.5, 0], [0, 0, 0, 0]], dtype=torch.float32)
    assert torch.allclose(batch.tensors["advantages"], expected)
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx((0 - 0.5 - 1) / 3)


def test_overlong_filter_masks_rows_and_the_sequence_count_leaves_them_out() -> None:
    # Row 1 reached max_new_tokens=3: filtered, so its response mask becomes all 0.
    algo = AlgorithmConfig.model_validate(
        {"adv_estimator": "reinforce", "policy_loss": "pg", "overlong": {"mode": "filter"}}
    )
    batch = _batch([1.0, 1.0, 0.5], [0, 1, 2], [2, 3, 1])
    advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=3)
    mask = batch.tensors["response_mask"]
    assert mask[1].sum() == 0 and mask[0].sum() == 2 and mask[2].sum() == 1
    assert batch.tensors["advantages"][1].abs().sum() == 0

    meta = mini_batch_meta(batch, max_response_length=3)
    assert meta == {"response_tokens": 3.0, "sequences": 2.0, "max_response_length": 3.0}
    # seq-mean-token-mean with the pipeline's global count equals agg_loss on the batch alone
    # (which skips masked rows): row means 1 (row 0) and 3 (row 2) -> (1 + 3) / 2 = 2, not
    # (1 + 3) / 3 as a count of every row would give.
    loss = torch.tensor([[1.0, 1.0, 0, 0], [5.0, 5.0, 5.0, 0], [3.0, 0, 0, 0]])
    with_global = agg_loss(loss, mask, "seq-mean-token-mean", global_num_seqs=meta["sequences"])
    assert float(with_global) == pytest.approx(2.0)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.0)


def test_kl_in_the_reward_by_hand() -> None:
    # k1 KL per token = old - ref = 0.5 on the last response token of row 0 (the only
    # response token); coef 0.1 -> reward 1 - 0.05 = 0.95; reinforce: advantage 0.95.
    algo = AlgorithmConfig.model_validate(
        {
            "adv_estimator": "reinforce",
            "policy_loss": "pg",
            "kl": {"coef": 0.1, "estimator": "k1", "use_as": "reward"},
        }
    )
    batch = _batch([1.0], [0], [1])
    batch.tensors["old_log_probs"] = torch.tensor([[-1.0, 0, 0, 0]])
    batch.tensors["ref_log_probs"] = torch.tensor([[-1.5, 0, 0, 0]])
    metrics = advantages_and_kl(batch, algo, RLState(algo), max_new_tokens=4)
    assert float(batch.tensors["advantages"][0, 0]) == pytest.approx(0.95)
    assert metrics["actor/reward_kl"] == pytest.approx(0.5)
