"""On-policy distillation: the per-token reverse KL to a teacher as the advantage.

The student samples its own responses; a frozen teacher scores every sampled token; the
advantage of token t of a response is

    A_t = coef * (log p_teacher(y_t | x, y_<t) - log p_student(y_t | x, y_<t))

the negative single-sample (k1) estimate of the per-token reverse KL KL(student || teacher),
so that maximising sum_t A_t * log p_student(y_t) with the policy gradient lowers the reverse
KL on the student's own samples. Source: Agarwal et al., "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes" (GKD, arXiv 2306.13649) with the reverse KL as
the divergence and student samples only (their lambda = 1); the per-token advantage with
no discounting and no baseline as in Thinking Machines' "On-Policy Distillation" (Lu et al.,
2025, no arXiv id) and ROLL's on-policy distillation.

Departures, each deliberate:

* ``p_student`` is the trainer's log-prob of the sampled token before the update
  (``old_log_probs``), not the sampler's: trainer and teacher then run the same forward
  code, and a teacher identical to the student gives exactly 0.
* ``mode: sequence`` (not in the sources) gives every token of a response the mean of that
  response's per-token terms: the whole response is credited with its average log-ratio,
  as a sequence-level reward would be (no per-token credit assignment).
* ``reward_weight`` adds the task reward's advantage (the recipe's estimator, e.g. GRPO) times
  that weight: GKD mixes a supervised term instead; the sum of two advantages is ROLL's mix.
* ``clip`` bounds each token's reverse-KL term to [-clip, clip] (not in the sources; off by
  default): one token the teacher finds impossible can otherwise dominate a batch.
* The student's term is its log-prob at the sampling temperature, and so is the teacher's
  (both ``log_softmax(logits / T)``): at T = 1 (the recipes) both are the raw distributions.
  Thinking Machines' cookbook takes the student's log-probs from the sampler instead.
* Loss aggregation is the recipe's (the ``grpo`` preset: mean over each response's tokens,
  then over responses); Thinking Machines sum over tokens. With one update per step the PPO
  ratio is exactly 1 and its clip never binds: the loss is their importance-sampling loss.

``mode: full`` is GKD as the paper writes it (Agarwal et al., sec. 3, with the reverse KL as
D and lambda = 1): no sampled estimate, no advantage; at every position of the student's own
sample the exact reverse KL of the two next-token distributions,

    KL_t = sum_v q_student(v | x, y_<t) (log q_student(v | ...) - log p_teacher(v | ...)),

is added to the loss (:func:`full_divergence`, aggregated as the policy loss is), and the
gradient does not flow through the sampling (as in GKD). ``top_k`` (roll's departure, as in
``roll distill``) groups both distributions into the teacher's k most likely tokens plus one
tail bucket: a lower bound of the full divergence, exact when the tail is negligible. Both are
first cut to the tokenizer's vocabulary (the model's output layer may be wider: embedding
padding), so ``top_k = V - 1`` gives the full divergence and the loss equals ``roll distill``'s
on the same logits.
``divergence: forward_kl | jsd`` (GKD's other divergences) replace the reverse KL there.
"""

from __future__ import annotations

from typing import Literal

import torch

from roll_core.algorithms.distill import DIVERGENCES, student_log_probs

DistillMode = Literal["token", "sequence", "full"]
DISTILL_MODES: tuple[str, ...] = ("token", "sequence", "full")


def on_policy_distill_advantages(
    *,
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: DistillMode = "token",
    coef: float = 1.0,
    clip: float | None = None,
    task_advantages: torch.Tensor | None = None,
    reward_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages ``[B, T]`` from the teacher's and the student's log-probs of the sampled
    tokens (all ``[B, T]``, 0/1 ``response_mask``), zero outside the mask.

    ``task_advantages`` (``[B, T]``, the estimator's advantages of the task reward) enters
    with weight ``reward_weight`` (0: pure distillation; it is not read). Returns the
    advantages and ``distill/...`` metrics: ``reverse_kl`` (the masked token mean of
    student - teacher log-prob, the k1 estimate of KL(student || teacher) per token),
    ``teacher_log_prob`` (masked mean) and ``kl_advantage_abs_max``. ``mode: full`` puts no
    reverse-KL term into the advantages (its signal is :func:`full_divergence` in the loss):
    only the task part remains, and the metrics are the same.
    """
    if mode not in DISTILL_MODES:
        raise ValueError(
            f"unknown on-policy distillation mode {mode!r}; valid: {', '.join(DISTILL_MODES)}"
        )
    mask = response_mask.to(teacher_log_probs.dtype)
    log_ratio = (teacher_log_probs - student_log_probs) * mask
    if clip is not None:
        log_ratio = log_ratio.clamp(-clip, clip) * mask
    tokens = mask.sum(dim=-1, keepdim=True)
    if mode == "sequence":  # each response's mean term on each of its tokens (0 for empty rows)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens.clamp(min=1)) * mask
    advantages = coef * log_ratio if mode != "full" else torch.zeros_like(log_ratio)
    if task_advantages is not None and reward_weight != 0.0:
        advantages = advantages + reward_weight * task_advantages * mask
    total = mask.sum().clamp(min=1)
    raw = (student_log_probs - teacher_log_probs) * mask
    metrics = {
        "distill/reverse_kl": float(raw.sum() / total),
        "distill/teacher_log_prob": float((teacher_log_probs * mask).sum() / total),
        "distill/kl_advantage_abs_max": float((coef * log_ratio).abs().max())
        if log_ratio.numel()
        else 0.0,
    }
    return advantages * mask, metrics


def full_divergence(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    *,
    vocab_size: int,
    divergence: str = "reverse_kl",
) -> torch.Tensor:
    """``mode: full``: the divergence of the two next-token distributions per position ``[N]``;
    ``reverse_kl`` (default) is ``KL(q_student || p_teacher)``, ``forward_kl`` and ``jsd`` (beta
    0.5) are GKD's other choices (:data:`~roll_core.algorithms.distill.DIVERGENCES`).

    ``student_logits`` ``[N, W]`` (already divided by the sampling temperature, with gradient;
    ``W`` the model's output width) are cut to ``vocab_size``, the tokenizer's vocabulary the
    teacher's distributions cover, before anything else: the embedding's padding rows beyond it
    are no token, with or without top-k. ``teacher_log_probs`` ``[N, K]`` from
    :func:`~roll_core.algorithms.distill.teacher_targets` at the same temperature over the same
    ``vocab_size``: ``K = vocab_size`` or, with ``teacher_ids`` ``[N, k]``, the teacher's top k
    plus its tail bucket (the student's distribution is grouped the same way)."""
    if not 0 < vocab_size <= student_logits.shape[-1]:
        raise ValueError(
            f"vocab_size {vocab_size} does not fit the student's {student_logits.shape[-1]} logits"
        )
    if teacher_ids is None and teacher_log_probs.shape[-1] != vocab_size:
        raise ValueError(
            f"the teacher's distributions have {teacher_log_probs.shape[-1]} entries, "
            f"not the vocabulary's {vocab_size}"
        )
    student = student_log_probs(student_logits[:, :vocab_size], teacher_ids)
    return DIVERGENCES.get(divergence)(student, teacher_log_probs.to(student.dtype))
