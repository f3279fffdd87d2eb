"""The `dpo` and `distill` training objectives: micro-batch -> the pure losses of
roll_core/algorithms/preference.py and roll_core/algorithms/distill.py.

Like every objective (see roll_core/workers/objectives.py) each returns this micro-batch's
share of the global loss and metric *sums*; the pipeline divides the sums by the global counts.

**DPO micro-batches** hold whole pairs, interleaved: rows ``2i`` (chosen) and ``2i + 1``
(rejected) of pair i, marked by ``pair_side`` (0 chosen, 1 rejected); ``ref_logps`` ``[2P]`` are
the reference policy's summed response log-probs; ``meta["pairs"]`` is the number of pairs in
the global batch. The DPO pipeline sets the backend's micro-batch to an even number of rows.

**Distill micro-batches** are SFT batches plus the teacher's targets at every next-token
position: ``teacher_logprobs`` ``[B, T-1, K]``, ``teacher_top1`` ``[B, T-1]`` and, with top-k,
``teacher_ids`` ``[B, T-1, k]``; ``meta["loss_tokens"]`` counts the trained tokens of the
global batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from roll_core.algorithms.distill import distill_loss
from roll_core.algorithms.preference import chosen_nll, preference_loss
from roll_core.backends.train.lm_head import HeadInput
from roll_core.backends.train.torch_backend import next_token_select
from roll_core.data import Batch


def _target_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (logp.gather(-1, targets[:, None]).squeeze(-1),)


def sequence_log_probs(logits: torch.Tensor | HeadInput, mb: Batch) -> torch.Tensor:
    """Summed log-probs of the response tokens (``loss_mask``) of every row: ``[B]``; only
    those positions' logits are computed, a chunk at a time (lm_head.py)."""
    mask = mb.tensors["loss_mask"][:, 1:].bool()
    targets = mb.tensors["input_ids"][:, 1:][mask]
    (picked,) = HeadInput.of(logits).map(_target_log_probs, next_token_select(mask), targets)
    per_token = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device)
    per_token = per_token.masked_scatter(mask, picked)
    return (per_token * mask.to(per_token.dtype)).sum(-1)


def dpo(
    logits: torch.Tensor | HeadInput,
    mb: Batch,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean preference loss over the pairs of the global batch (this micro-batch's share).

    ``sft_weight`` > 0 adds that multiple of each chosen response's token-mean negative
    log-likelihood to its pair's loss (RPO, arXiv 2404.19733).
    """
    side = mb.tensors["pair_side"]
    if len(mb) % 2 or bool((side[0::2] != 0).any()) or bool((side[1::2] != 1).any()):
        raise ValueError("a DPO micro-batch must hold whole pairs: rows (chosen, rejected)*")
    logps = sequence_log_probs(logits, mb)
    ref = mb.tensors["ref_logps"].to(logps.device)
    out = preference_loss(
        logps[0::2],
        logps[1::2],
        ref[0::2],
        ref[1::2],
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    tokens = mb.tensors["loss_mask"][0::2, 1:].sum(-1).clamp(min=1).to(logps.dtype)
    nll = chosen_nll(logps[0::2], tokens)
    losses = out.losses + sft_weight * nll if sft_weight else out.losses
    loss = losses.sum() / float(mb.meta["pairs"])
    margin = out.chosen_rewards - out.rejected_rewards
    chosen_logps, rejected_logps = logps.detach()[0::2], logps.detach()[1::2]
    return loss, {
        "dpo/pairs": float(len(margin)),
        "dpo/loss_sum": float(losses.detach().sum()),
        "dpo/nll_sum": float(nll.detach().sum()),
        "dpo/rewards_chosen_sum": float(out.chosen_rewards.sum()),
        "dpo/rewards_rejected_sum": float(out.rejected_rewards.sum()),
        "dpo/margin_sum": float(margin.sum()),
        "dpo/accuracy_sum": float((margin > 0).sum()),
        "dpo/logp_accuracy_sum": float((chosen_logps > rejected_logps).sum()),
        "dpo/logps_chosen_sum": float(chosen_logps.sum()),
        "dpo/logps_rejected_sum": float(rejected_logps.sum()),
    }


def _distill_chunk(
    logits: torch.Tensor,
    teacher_logp: torch.Tensor,
    top1: torch.Tensor,
    *ids: torch.Tensor,
    vocab_size: int,
    **loss: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of trained positions: (losses, forward KL, agreement with the teacher's top
    token), each ``[n]``, from the student's logits ``[n, W]`` cut to ``vocab_size``."""
    student = logits[:, :vocab_size]
    losses, kl = distill_loss(student, teacher_logp, ids[0] if ids else None, **loss)  # type: ignore[arg-type]
    return losses, kl, student.detach().argmax(-1) == top1


def distill(
    logits: torch.Tensor | HeadInput,
    mb: Batch,
    *,
    loss_type: str = "forward_kl",
    temperature: float = 1.0,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
    vocab_size: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean distillation loss over the trained tokens of the global batch.

    ``vocab_size`` is the shared tokenizer's size: logits beyond it (padding rows of the
    embedding, which differ between model sizes) are dropped. Only the trained positions'
    logits are computed, a chunk at a time (lm_head.py).
    """
    t = mb.tensors
    mask = t["loss_mask"][:, 1:].bool()
    extras = [t["teacher_logprobs"][mask], t["teacher_top1"][mask]]
    if "teacher_ids" in t:
        extras.append(t["teacher_ids"][mask])
    fn = functools.partial(
        _distill_chunk,
        vocab_size=vocab_size,
        loss_type=loss_type,
        temperature=temperature,
        skew_alpha=skew_alpha,
        jsd_beta=jsd_beta,
    )
    losses, kl, agree = HeadInput.of(logits).map(fn, next_token_select(mask), *extras)
    loss = losses.sum() / float(mb.meta["loss_tokens"])
    return loss, {
        "distill/tokens": float(mask.sum()),
        "distill/loss_sum": float(losses.detach().sum()),
        "distill/kl_sum": float(kl.sum()),
        "distill/agree_sum": float(agree.sum()),
    }


PREFERENCE_OBJECTIVES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "dpo": dpo,
    "distill": distill,
}
"""Added to roll_core.workers.objectives.OBJECTIVES."""
