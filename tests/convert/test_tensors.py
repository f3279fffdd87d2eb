"""Tensor rules of roll_core/convert/tensors.py, with hand-written numbers."""

from __future__ import annotations

import pytest
import torch

from roll_core.convert.tensors import (
    gate_up_from_mcore,
    gate_up_to_mcore,
    merge_tp,
    pad_vocab,
    padded_vocab_size,
    qkv_from_mcore,
    qkv_to_mcore,
    rotary_halves_from_interleaved,
    split_tp,
    unpad_vocab,
)
from roll_core.errors import CheckpointError, UsageError


def col(*values: float) -> torch.Tensor:
    """A [n, 1] weight whose rows are ``values`` (one input feature keeps the numbers readable)."""
    return torch.tensor(values).reshape(-1, 1)


def test_qkv_is_grouped_by_query_group() -> None:
    # 4 query heads, 2 key/value groups, head_dim 1: group g owns query heads 2g, 2g+1.
    q = col(10, 11, 12, 13)  # q heads 0..3
    k = col(20, 21)  # k of groups 0, 1
    v = col(30, 31)  # v of groups 0, 1
    fused = qkv_to_mcore(q, k, v, num_heads=4, num_kv_heads=2, head_dim=1)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = qkv_from_mcore(fused, num_heads=4, num_kv_heads=2, head_dim=1)
    assert [t.flatten().tolist() for t in back] == [[10, 11, 12, 13], [20, 21], [30, 31]]


def test_qkv_bias_and_head_dim_2() -> None:
    # Biases are 1-D. MQA: 2 heads, 1 group, head_dim 2: q = [1 2 | 3 4], k = [5 6], v = [7 8]
    q, k, v = torch.tensor([1.0, 2, 3, 4]), torch.tensor([5.0, 6]), torch.tensor([7.0, 8])
    assert qkv_to_mcore(q, k, v, num_heads=2, num_kv_heads=1, head_dim=2).tolist() == [
        1, 2, 3, 4, 5, 6, 7, 8,
    ]  # fmt: skip
    # MHA: 2 heads, 2 groups, head_dim 2: k = [5 6 | 9 10], v = [7 8 | 11 12]
    k2, v2 = torch.tensor([5.0, 6, 9, 10]), torch.tensor([7.0, 8, 11, 12])
    fused = qkv_to_mcore(q, k2, v2, num_heads=2, num_kv_heads=2, head_dim=2)
    # group 0: q0 = 1 2, k0 = 5 6, v0 = 7 8; group 1: q1 = 3 4, k1 = 9 10, v1 = 11 12
    assert fused.tolist() == [1, 2, 5, 6, 7, 8, 3, 4, 9, 10, 11, 12]
    assert [t.tolist() for t in qkv_from_mcore(fused, num_heads=2, num_kv_heads=2, head_dim=2)] == [
        [1, 2, 3, 4], [5, 6, 9, 10], [7, 8, 11, 12],
    ]  # fmt: skip
    # 4 heads + 2 * 2 groups of size 1 need 8 rows, not 7
    with pytest.raises(CheckpointError, match="linear_qkv has 7 rows"):
        qkv_from_mcore(torch.zeros(7, 3), num_heads=4, num_kv_heads=2, head_dim=1)


def test_qkv_tensor_parallel_keeps_whole_groups() -> None:
    # 4 heads, 2 groups, head_dim 1 -> 8 fused rows; tp=2 gives each rank one whole group.
    fused = qkv_to_mcore(
        col(10, 11, 12, 13), col(20, 21), col(30, 31), num_heads=4, num_kv_heads=2, head_dim=1
    )
    r0, r1 = split_tp(fused, "column", 2)
    assert r0.flatten().tolist() == [10, 11, 20, 30]  # q0 q1 k0 v0
    assert r1.flatten().tolist() == [12, 13, 21, 31]  # q2 q3 k1 v1
    assert torch.equal(merge_tp([r0, r1], "column"), fused)


def test_gated_fc1_is_interleaved_per_rank() -> None:
    gate, up = col(1, 2, 3, 4), col(5, 6, 7, 8)  # ffn 4
    fc1 = gate_up_to_mcore(gate, up)
    assert fc1.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # tp=2: rank r holds [gate_r; up_r] = rank 0 [1 2 5 6], rank 1 [3 4 7 8]
    r0, r1 = split_tp(fc1, "gated_column", 2)
    assert r0.flatten().tolist() == [1, 2, 5, 6]
    assert r1.flatten().tolist() == [3, 4, 7, 8]
    merged = merge_tp([r0, r1], "gated_column")
    assert merged.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    g, u = gate_up_from_mcore(merged)
    assert g.flatten().tolist() == [1, 2, 3, 4] and u.flatten().tolist() == [5, 6, 7, 8]


def test_row_parallel_splits_input_features() -> None:
    w = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])  # [out 2, in 4]
    r0, r1 = split_tp(w, "row", 2)
    assert r0.tolist() == [[1, 2], [5, 6]] and r1.tolist() == [[3, 4], [7, 8]]
    assert torch.equal(merge_tp([r0, r1], "row"), w)


def test_replicated_takes_one_copy() -> None:
    w = torch.tensor([1.0, 2.0])
    assert split_tp(w, "replicated", 3) == [w, w, w]
    assert merge_tp([w, w.clone()], "replicated").tolist() == [1, 2]


def test_merge_refuses_shards_of_different_shapes() -> None:
    with pytest.raises(CheckpointError, match=r"different shapes.*\(2, 3\), \(4, 3\)"):
        merge_tp([torch.zeros(2, 3), torch.zeros(4, 3)], "column", name="x")


def test_split_refuses_uneven_sizes() -> None:
    with pytest.raises(UsageError, match="do not split evenly over tensor-parallel size 4"):
        split_tp(torch.zeros(6, 2), "column", 4)
    # gated: 2 * ffn rows must split into tp gate chunks and tp up chunks: ffn 3, tp 2 fails
    with pytest.raises(UsageError):
        split_tp(torch.zeros(6, 2), "gated_column", 2)


def test_vocab_padding() -> None:
    # Megatron pads 250 to the next multiple of 64 * tp 2 = 128 -> 256
    assert padded_vocab_size(250, 64, 2) == 256
    assert padded_vocab_size(256, 64, 2) == 256
    assert padded_vocab_size(257, 128, 1) == 384
    emb = torch.arange(6.0).reshape(3, 2)
    padded = pad_vocab(emb, 5)
    assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [0, 0], [0, 0]]
    assert torch.equal(unpad_vocab(padded, 3), emb)
    with pytest.raises(CheckpointError, match="larger than the checkpoint's embedding"):
        unpad_vocab(emb, 4)


def test_interleaved_rotary_rows_become_halves() -> None:
    # 2 heads of head_dim 4: per head, even dimensions first, then odd ones:
    # rows 0..3 -> 0, 2, 1, 3; rows 4..7 -> 4, 6, 5, 7
    t = col(0, 1, 2, 3, 4, 5, 6, 7)
    out = rotary_halves_from_interleaved(t, head_dim=4)
    assert out.flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    norm = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a per-head q/k norm weight: one "head"
    assert rotary_halves_from_interleaved(norm, head_dim=4).tolist() == [1.0, 3.0, 2.0, 4.0]


def test_interleaved_rotary_scores_equal_rotate_half_scores() -> None:
    # head_dim 4, frequencies f0, f1. Interleaved RoPE rotates pairs (0,1) by f0*pos, (2,3) by
    # f1*pos; HF's rotate_half rotates (0,2) by f0*pos, (1,3) by f1*pos. After the reordering,
    # q.k at positions (m, n) is the same.
    def rot(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, angle: torch.Tensor) -> None:
        xa, xb = x[a].clone(), x[b].clone()
        x[a], x[b] = xa * angle.cos() - xb * angle.sin(), xb * angle.cos() + xa * angle.sin()

    freqs = torch.tensor([1.0, 0.01])
    q, k = torch.randn(4, generator=torch.Generator().manual_seed(0)), torch.randn(4)
    m, n = 5.0, 2.0
    mq, mk = q.clone(), k.clone()  # Megatron, interleaved
    for i, f in enumerate(freqs):
        rot(mq, torch.tensor(2 * i), torch.tensor(2 * i + 1), f * m)
        rot(mk, torch.tensor(2 * i), torch.tensor(2 * i + 1), f * n)
    hq = rotary_halves_from_interleaved(q, head_dim=4).clone()  # HF, halves
    hk = rotary_halves_from_interleaved(k, head_dim=4).clone()
    for i, f in enumerate(freqs):
        rot(hq, torch.tensor(i), torch.tensor(i + 2), f * m)
        rot(hk, torch.tensor(i), torch.tensor(i + 2), f * n)
    assert torch.allclose(mq @ mk, hq @ hk, atol=1e-6)
    assert not torch.allclose(mq @ mk, (q.clone() @ k), atol=1e-3)  # the rotation did act
