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

from collections.abc import Callable
from typing import Any

import torch

from roll_core.algorithms.distill import distill_loss
from roll_core.algorithms.preference import chosen_nll, preference_loss
from roll_core.backends.train.lm_head import LMHead, as_head, target_log_probs
from roll_core.data import Batch


def sequence_log_probs(logits: LMHead | torch.Tensor, mb: Batch) -> torch.Tensor:
    """Summed log-probs of the response tokens (``loss_mask``) of every row: ``[B]``."""
    mask = mb.tensors["loss_mask"][:, 1:]
    per_token = target_log_probs(logits, mb.tensors["input_ids"], mask)
    return (per_token * mask.to(per_token.dtype)).sum(-1)


def dpo(
    logits: LMHead | torch.Tensor,
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


def distill(
    logits: LMHead | torch.Tensor,
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
    embedding, which differ between model sizes) are dropped.
    """
    mask = mb.tensors["loss_mask"][:, 1:].bool()
    inputs = [mb.tensors["teacher_logprobs"][mask]]
    if "teacher_ids" in mb.tensors:
        inputs.append(mb.tensors["teacher_ids"][mask])

    def fn(logits: torch.Tensor, teacher_logp: torch.Tensor, *ids: torch.Tensor) -> Any:
        student = logits[:, :vocab_size]
        losses, kl = distill_loss(
            student,
            teacher_logp,
            ids[0] if ids else None,
            loss_type=loss_type,
            temperature=temperature,
            skew_alpha=skew_alpha,
            jsd_beta=jsd_beta,
        )
        return losses, kl, student.detach().argmax(-1)

    losses, kl, top1 = as_head(logits).map(mask, fn, *inputs)
    loss = losses.sum() / float(mb.meta["loss_tokens"])
    agree = top1 == mb.tensors["teacher_top1"][mask]
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
