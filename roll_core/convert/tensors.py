"""Tensor rules of the conversion: Hugging Face <-> Megatron layouts, and tensor-parallel
split / merge.

Pure functions on tensors (no files, no config objects), so each rule is unit-tested with
hand-written numbers.

Megatron's fused QKV is grouped by query group: for each of the ``num_kv_heads`` groups, the
``num_heads // num_kv_heads`` query heads of the group, then its key head, then its value head
(``head_dim`` rows each). Tensor parallelism splits it into contiguous blocks of whole groups,
so the global (merged) tensor is the concatenation of the ranks' tensors.

Megatron's fused ``linear_fc1`` of a gated MLP is ``[gate; up]`` on *each* rank: rank ``r``
holds ``[gate_r; up_r]``. The global tensor (what ``torch_dist`` stores, and what the HF side
needs) is ``[gate_0 .. gate_{tp-1}; up_0 .. up_{tp-1}]``.
"""

from __future__ import annotations

import torch

from roll_core.errors import CheckpointError, UsageError

TP_RULES = ("replicated", "column", "row", "gated_column", "vocab")


# -- HF <-> Megatron (global, unsplit) -------------------------------------------------------


def qkv_to_mcore(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Fuse HF ``q_proj``, ``k_proj``, ``v_proj`` (weights ``[n*d, hidden]`` or biases
    ``[n*d]``) into Megatron's ``linear_qkv``: ``[kv_heads * (heads/kv_heads + 2) * d, ...]``."""
    groups = num_kv_heads
    per_group = num_heads // num_kv_heads
    rest = q.shape[1:]
    try:
        parts = (
            q.reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        )
    except RuntimeError as e:
        raise CheckpointError(
            f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not fit "
            f"{num_heads} heads, {num_kv_heads} key/value heads of size {head_dim}.",
            hint="The config does not describe these weights; check config.json.",
        ) from e
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_from_mcore(
    qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's fused ``linear_qkv`` back into HF ``(q, k, v)``."""
    groups = num_kv_heads
    per_group = num_heads // num_kv_heads
    rest = qkv.shape[1:]
    expected = groups * (per_group + 2) * head_dim
    if qkv.shape[0] != expected:
        raise CheckpointError(
            f"linear_qkv has {qkv.shape[0]} rows; {num_heads} heads and {num_kv_heads} query "
            f"groups of size {head_dim} need {expected}.",
            hint="The checkpoint's args do not describe its weights; pass --hf-config with "
            "the right shape.",
        )
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def rotary_halves_from_interleaved(t: torch.Tensor, *, head_dim: int) -> torch.Tensor:
    """Reorder the rows of each ``head_dim`` block of ``t`` (q or k rows, their bias, a per-head
    norm weight) from Megatron's interleaved rotary layout to HF's ``rotate_half`` one.

    Megatron with ``rotary_interleaved`` rotates the pairs of dimensions ``(0, 1), (2, 3), ...``
    of a head by frequencies ``0, 1, ...``; HF rotates ``(i, i + head_dim/2)`` by frequency ``i``.
    Taking the even dimensions first and then the odd ones (``[0, 2, .., d-2, 1, 3, .., d-1]``)
    moves pair ``(2i, 2i+1)`` to ``(i, i + d/2)``; q and k get the same order, so every
    dot product ``q . k`` (the only use of the rotated dimensions) is unchanged.
    """
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def gate_up_to_mcore(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj`` and ``up_proj`` -> global Megatron ``linear_fc1`` ``[gate; up]``."""
    return torch.cat([gate, up], dim=0)


def gate_up_from_mcore(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global Megatron ``linear_fc1`` -> HF ``(gate_proj, up_proj)``."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    """Append zero rows so the vocabulary dimension (0) has ``padded`` rows."""
    if padded < t.shape[0]:
        raise UsageError(
            f"cannot pad a vocabulary of {t.shape[0]} rows to {padded}.",
            hint="Use a larger --make-vocab-size-divisible-by or check the config's vocab_size.",
        )
    if padded == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], dim=0)


def unpad_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop Megatron's vocabulary padding: keep the first ``vocab_size`` rows."""
    if vocab_size > t.shape[0]:
        raise CheckpointError(
            f"the vocabulary size {vocab_size} is larger than the checkpoint's embedding "
            f"({t.shape[0]} rows).",
            hint="Pass the model's real vocabulary size with --vocab-size or --hf-config.",
        )
    return t[:vocab_size].contiguous()


# -- tensor parallel -------------------------------------------------------------------------


def split_tp(t: torch.Tensor, rule: str, tp: int, *, name: str = "tensor") -> list[torch.Tensor]:
    """The ``tp`` per-rank tensors of global tensor ``t`` under ``rule`` (see TP_RULES)."""
    if rule == "replicated" or tp == 1:
        return [t] * tp
    dim = 1 if rule == "row" else 0
    if t.shape[dim] % (2 * tp if rule == "gated_column" else tp):
        raise UsageError(
            f"{name} has {t.shape[dim]} rows in dimension {dim}, which do not split evenly "
            f"over tensor-parallel size {tp}.",
            hint="Choose a --tp that divides the number of key/value heads, the MLP size and "
            "the hidden size.",
        )
    if rule == "gated_column":
        gate, up = torch.chunk(t, 2, dim=0)
        return [
            torch.cat([g, u], dim=0)
            for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp), strict=True)
        ]
    # clone: a chunk is a view, and torch.save would write the whole tensor's storage
    return [c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(t, tp, dim=dim)]


def merge_tp(shards: list[torch.Tensor], rule: str, *, name: str = "tensor") -> torch.Tensor:
    """The global tensor from its per-rank ``shards`` (inverse of :func:`split_tp`)."""
    if rule not in TP_RULES:
        raise ValueError(f"unknown tensor-parallel rule {rule!r}")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise CheckpointError(
            f"{name} has different shapes on the tensor-parallel ranks: "
            + ", ".join(str(tuple(s.shape)) for s in shards)
            + ".",
            hint="The shards come from different runs or tensor-parallel sizes; check that every "
            "mp_rank_* directory belongs to the same checkpoint.",
        )
    if rule == "replicated" or len(shards) == 1:
        return shards[0]
    if rule == "row":
        return torch.cat(shards, dim=1)
    if rule == "gated_column":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
