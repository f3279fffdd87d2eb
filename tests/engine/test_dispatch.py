"""Token-balanced data-parallel split and the merge of per-rank metrics (pure)."""

from __future__ import annotations

import pytest
import torch

from roll_core.data import Batch
from roll_core.engine.dispatch import balanced_cuts, reduce_rank_metrics, split_by_tokens


def test_cuts_balance_tokens_not_rows() -> None:
    # tokens 10,10,1,1,1,1 (total 24, half 12): prefixes 10, 20, ... -> cut after row 0
    # (10 | 14 tokens), where a row split would give 21 | 3
    assert balanced_cuts([10, 10, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balanced_cuts([1, 1, 1, 1, 1, 1], 3) == [(0, 2), (2, 4), (4, 6)]
    # every range keeps at least one row even when one row dominates
    assert balanced_cuts([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]


def test_cuts_refuse_more_ranks_than_rows() -> None:
    with pytest.raises(ValueError, match="Cannot split a batch of 2 samples into 3"):
        balanced_cuts([1, 1], 3)


def test_split_by_tokens_keeps_order_and_uses_attention_mask() -> None:
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    batch = Batch(tensors={"attention_mask": mask, "x": torch.arange(5)}, meta={"k": 1})
    # tokens 4,4,1,1,2 (total 12, half 6): prefixes 4 and 8 are both 2 away; the later cut
    # wins -> rows [0, 1] | [2, 3, 4] = 8 | 4 tokens (a row split would give 9 | 3)
    shards = split_by_tokens(batch, 2)
    assert [s["x"].tolist() for s in shards] == [[0, 1], [2, 3, 4]]
    assert shards[0].meta == {"k": 1}
    # tokens 4,1,1,1,1 (total 8, half 4): cut after row 0 -> 4 | 4
    mask2 = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])
    shards = split_by_tokens(Batch(tensors={"attention_mask": mask2, "x": torch.arange(5)}), 2)
    assert [s["x"].tolist() for s in shards] == [[0], [1, 2, 3, 4]]
    no_mask = Batch(tensors={"x": torch.arange(5)})  # rows: larger shard first
    assert [s["x"].tolist() for s in split_by_tokens(no_mask, 2)] == [[0, 1, 2], [3, 4]]


def test_reduce_rank_metrics() -> None:
    ranks = [
        {"train/loss_sum": 2.0, "train/grad_norm": 3.0, "train/lr": 0.1, "perf/train_s": 1.0},
        {"train/loss_sum": 5.0, "train/grad_norm": 3.0, "train/lr": 0.1, "perf/train_s": 4.0},
    ]
    assert reduce_rank_metrics(ranks) == {
        "train/loss_sum": 7.0,  # sums add up
        "train/grad_norm": 3.0,  # global already: rank 0
        "train/lr": 0.1,
        "perf/train_s": 4.0,  # the slowest rank
    }
