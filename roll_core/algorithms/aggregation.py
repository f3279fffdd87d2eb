"""Loss aggregation: a per-token loss matrix ``[B, T]`` -> one scalar.

How the token losses are averaged decides how much each response weighs in the update, and the
papers disagree:

* ``token-mean``: every response token of the batch weighs the same, so long responses weigh
  more (DAPO, arXiv 2503.14476, "token-level policy gradient loss"; LitePPO).
* ``seq-mean-token-mean``: mean over each response's tokens, then mean over responses: every
  response weighs the same, so a token of a short response weighs more (GRPO, arXiv
  2402.03300, eq. 3; GSPO).
* ``seq-mean-token-sum``: sum over each response's tokens, mean over responses (REINFORCE on
  whole-sequence log-probabilities; TOPR).
* ``seq-mean-token-sum-norm``: sum over each response's tokens divided by a constant (the
  maximum response length), mean over responses (Dr.GRPO, arXiv 2503.20783: removes
  the length bias of ``seq-mean-token-mean`` without making the loss scale depend on the batch).

Gradient accumulation and data parallelism: a micro-batch only sees its own rows, but the update
must be that of the whole global batch. Pass ``global_num_tokens`` (response tokens in the
global batch) and ``global_num_seqs`` (rows with at least one response token in the global
batch); the micro-batch then returns its *share* of the global loss, and the shares add up
(over micro-batches and ranks) to the loss of one big batch.
"""

from __future__ import annotations

import torch

from roll_core.algorithms.registry import unknown_name_error

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""Valid values of `agg_mode` (and of the recipe key `algorithm.loss_agg_mode`)."""


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    *,
    max_len: int | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``[B, T]`` into a scalar with the given `mode`.

    Args:
        loss_mat: per-token losses ``[B, T]``.
        response_mask: ``[B, T]``, 1 on response tokens, 0 on padding.
        mode: one of :data:`LOSS_AGG_MODES` (see the module docstring).
        max_len: the constant divisor of ``seq-mean-token-sum-norm``; None uses ``T`` (the
            padded width of this batch). Pass the generation length limit so the scale does
            not change with how a batch happened to be padded.
        global_num_tokens: response tokens of the whole global batch (``token-mean``); None
            uses this batch's count.
        global_num_seqs: rows with at least one response token in the whole global batch
            (``seq-mean-*``); None uses this batch's count.

    Rows without any response token (e.g. a response dropped by ``overlong.mode: filter``)
    contribute 0 and are not counted as sequences, so they do not dilute the loss; current verl
    does the same (its ``seq_mask``), earlier verl releases counted them. ``global_num_seqs``
    must count the same way (the RL pipelines pass the rows with a response token). An empty
    batch gives 0, never NaN.
    """
    if mode not in LOSS_AGG_MODES:
        raise unknown_name_error(
            "loss aggregation mode", mode, list(LOSS_AGG_MODES), key="algorithm.loss_agg_mode"
        )
    m = response_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if global_num_tokens is None:
            return (loss_mat * m).sum() / m.sum().clamp(min=1)
        return (loss_mat * m).sum() / max(float(global_num_tokens), 1.0)
    tokens_per_seq = m.sum(dim=-1)
    seq_sums = (loss_mat * m).sum(dim=-1)
    seqs: torch.Tensor | float
    if global_num_seqs is None:
        seqs = (tokens_per_seq > 0).to(loss_mat.dtype).sum().clamp(min=1)
    else:
        seqs = max(float(global_num_seqs), 1.0)
    if mode == "seq-mean-token-mean":
        return (seq_sums / tokens_per_seq.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    norm = float(loss_mat.shape[-1] if max_len is None else max_len)
    if norm <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    return seq_sums.sum() / (seqs * norm)
