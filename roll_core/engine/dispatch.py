"""How a cluster splits a Batch over its data-parallel ranks and collects what comes back.

Pure functions (no processes, no Ray): unit-tested in tests/engine/test_dispatch.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from roll_core.data import Batch

SAME_ON_EVERY_RANK = ("train/grad_norm", "train/lr")
"""Metrics every rank computes identically (global after the all-reduce): taken from rank 0."""


def row_tokens(batch: Batch) -> list[int]:
    """Real (unpadded) tokens per row: `attention_mask` sums, or 1 per row without a mask."""
    mask = batch.tensors.get("attention_mask")
    if mask is None:
        return [1] * len(batch)
    return [int(x) for x in mask.reshape(len(batch), -1).sum(dim=1).tolist()]


def balanced_cuts(weights: Sequence[int], n: int) -> list[tuple[int, int]]:
    """`n` contiguous, non-empty [start, stop) ranges over `weights` with near-equal sums.

    Cut k goes where the running sum is closest to k/n of the total (ties: the later
    position, so equal weights split like `Batch.split`, larger ranges first), leaving at least one row for each later range. Contiguous ranges keep the
    batch order, so per-rank results concatenate back in the caller's order.
    """
    rows = len(weights)
    if n < 1 or n > rows:
        raise ValueError(f"Cannot split a batch of {rows} samples into {n} chunks.")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    cuts, start = [], 0
    for k in range(1, n):
        target = total * k / n
        lo, hi = start + 1, rows - (n - k)  # this range ends at `stop` in [lo, hi]
        stop = min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - target), -j))
        cuts.append((start, stop))
        start = stop
    cuts.append((start, rows))
    return cuts


def split_by_tokens(batch: Batch, n: int) -> list[Batch]:
    """`batch` as `n` contiguous shards with near-equal real-token counts (data parallel)."""
    if n == 1:
        return [batch]
    return [batch.select(torch.arange(a, b)) for a, b in balanced_cuts(row_tokens(batch), n)]


def reduce_rank_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: sums (objective sums, token counts), except the
    metrics that are global already (`SAME_ON_EVERY_RANK`, from rank 0), timings (`*_s`: the
    slowest rank) and maxima (`*_max`: the largest)."""
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [float(m[key]) for m in per_rank if key in m]
        if key in SAME_ON_EVERY_RANK:
            out[key] = values[0]
        elif key.endswith(("_s", "_max")):  # `_max`: backends.train.base.is_max_metric
            out[key] = max(values)
        else:
            out[key] = sum(values)
    return out


def concat_results(per_rank: Sequence[Any]) -> Any:
    """The per-rank results of a ``dp`` call as one value in batch order: tensors and
    Batches joined along the first dimension, dicts of tensors key by key."""
    first = per_rank[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(per_rank))
    if isinstance(first, Batch):
        return Batch.concat(list(per_rank))
    if isinstance(first, dict):
        return {key: concat_results([r[key] for r in per_rank]) for key in first}
    raise TypeError(
        f"collect='concat' joins tensors, Batches or dicts of tensors, not {type(first).__name__}"
    )


def collect_results(per_rank: list[Any], how: str) -> Any:
    """What a cluster call returns for the per-rank results under ``@dispatch(collect=how)``
    (roll_core/engine/worker.py): the list itself, one concatenated value, reduced metrics or
    rank 0's result."""
    if how == "list":
        return per_rank
    if how == "concat":
        return concat_results(per_rank)
    if how == "metrics":
        return reduce_rank_metrics(per_rank)
    if how == "rank0":
        return per_rank[0]
    raise ValueError(f"unknown collect mode {how!r} (list, concat, metrics, rank0)")
