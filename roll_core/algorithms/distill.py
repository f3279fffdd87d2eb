"""Token-level knowledge distillation: divergences between teacher and student next-token
distributions, with temperature and an optional top-k of the teacher.

At every trained position the teacher's distribution ``p`` and the student's ``q`` (both
softened by the temperature ``tau``: ``softmax(logits / tau)``) are compared with one of:

* ``forward_kl``: ``KL(p || q)``, Hinton et al. 2015 (arXiv 1503.02531), mass-covering;
* ``reverse_kl``: ``KL(q || p)``, as in MiniLLM (arXiv 2306.08543), mode-seeking; here
  computed exactly on the teacher's distribution (no policy-gradient sampling, unlike MiniLLM);
* ``jsd``: the generalised Jensen-Shannon divergence of GKD (arXiv 2306.13649, eq. 5):
  ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``;
  ``jsd_beta = 0.5`` is the symmetric JS divergence;
* ``skew_forward_kl``: DistiLLM's skew KL (arXiv 2402.03898, eq. 4):
  ``KL(p || alpha p + (1 - alpha) q)``;
* ``skew_reverse_kl``: DistiLLM's skew reverse KL: ``KL(q || alpha q + (1 - alpha) p)``.

The loss is multiplied by ``tau^2`` (Hinton et al.), so its gradient keeps its scale when the
temperature changes.

**Top-k.** Full teacher distributions are ``[tokens, vocab]`` (152k entries per token for
Qwen). With ``top_k = k`` the teacher sends only its k most likely tokens plus one *tail*
bucket holding the rest of its mass (computed exactly from its full logits). The student's
distribution is grouped the same way: its probabilities of those k tokens and its own tail
mass. The divergence of the grouped distributions is a lower bound of the full one (grouping
never increases an f-divergence) and equals it when the tail is negligible; it is computed on
``k + 1`` entries. Departure from the papers: they use full distributions.

**Vocabulary.** Both distributions are over the tokenizer's ``V`` tokens: callers cut both
models' logits to ``V`` before these functions (an output layer is often wider: 151,936 rows
for Qwen's 151,669 tokens, 320 for the built-in tiny models' 259), so neither softmax nor the
tail bucket holds the padding rows' mass and ``top_k = V - 1`` is the full divergence.

Shapes: positions are flattened, ``[N, V]`` logits and ``[N, K]`` grouped log-probs
(``K = V`` without top-k, ``k + 1`` with it); per-position outputs are ``[N]``.
"""

from __future__ import annotations

import math

import torch

from roll_core.algorithms.registry import Registry

LOG_FLOOR = -1e4
"""Log-probabilities are clamped here so ``p log p`` is 0 (not NaN) for a zero probability."""

DIVERGENCES: Registry = Registry("distillation loss", key="distill.loss")
"""Name -> ``fn(student_logp [N, K], teacher_logp [N, K], *, skew_alpha, jsd_beta) -> [N]``."""


def kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_i p_i (log p_i - log q_i)`` over the last dim, from log-probs."""
    logp, logq = logp.clamp(min=LOG_FLOOR), logq.clamp(min=LOG_FLOOR)
    return (logp.exp() * (logp - logq)).sum(-1)


def _mix(logp: torch.Tensor, logq: torch.Tensor, weight: float) -> torch.Tensor:
    """``log(weight p + (1 - weight) q)`` computed in log space."""
    return torch.logaddexp(logp + math.log(weight), logq + math.log1p(-weight))


@DIVERGENCES.register("forward_kl")
def forward_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """``KL(p_teacher || q_student)`` per position."""
    return kl(teacher_logp, student_logp)


@DIVERGENCES.register("reverse_kl")
def reverse_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """``KL(q_student || p_teacher)`` per position."""
    return kl(student_logp, teacher_logp)


@DIVERGENCES.register("jsd")
def jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """GKD's ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``."""
    _check_open_unit("jsd_beta", jsd_beta)
    mix = _mix(teacher_logp, student_logp, jsd_beta)
    return jsd_beta * kl(teacher_logp, mix) + (1.0 - jsd_beta) * kl(student_logp, mix)


@DIVERGENCES.register("skew_forward_kl")
def skew_forward_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """``KL(p || alpha p + (1 - alpha) q)`` per position."""
    _check_open_unit("skew_alpha", skew_alpha)
    return kl(teacher_logp, _mix(teacher_logp, student_logp, skew_alpha))


@DIVERGENCES.register("skew_reverse_kl")
def skew_reverse_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """``KL(q || alpha q + (1 - alpha) p)`` per position."""
    _check_open_unit("skew_alpha", skew_alpha)
    return kl(student_logp, _mix(student_logp, teacher_logp, skew_alpha))


def _check_open_unit(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")


def teacher_targets(
    teacher_logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The teacher's grouped log-probs ``[N, K]`` and, with top-k, its token ids ``[N, k]``.

    Without ``top_k`` (or when ``top_k >= V``) this is ``log_softmax(logits / tau)`` over the
    whole vocabulary and the ids are None. With it: the k largest log-probs in descending
    order, then the log of the remaining mass (the tail bucket).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if top_k is None or top_k >= logp.shape[-1]:
        return logp, None
    values, ids = logp.topk(top_k, dim=-1)
    tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([values, tail], dim=-1), ids


def student_log_probs(
    student_logits: torch.Tensor, teacher_ids: torch.Tensor | None, *, temperature: float = 1.0
) -> torch.Tensor:
    """The student's log-probs grouped like the teacher's: ``[N, V]``, or ``[N, k + 1]`` (the
    teacher's top-k tokens, then the student's mass on every other token) when ids are given."""
    logp = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    if teacher_ids is None:
        return logp
    values = logp.gather(-1, teacher_ids)
    tail = torch.logsumexp(logp.scatter(-1, teacher_ids, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([values, tail], dim=-1)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    *,
    loss_type: str = "forward_kl",
    temperature: float = 1.0,
    skew_alpha: float = 0.1,
    jsd_beta: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position distillation loss ``[N]`` (times ``tau^2``) and forward KL ``[N]`` (a
    detached metric, no ``tau^2``).

    Args:
        student_logits: ``[N, V]`` raw student logits at the trained positions, cut to the
            tokenizer's vocabulary as the teacher's were.
        teacher_logp: ``[N, K]`` from :func:`teacher_targets` at the same temperature.
        teacher_ids: ``[N, k]`` token ids of the teacher's top-k, or None (full vocabulary).
        loss_type: a name in :data:`DIVERGENCES`.
    """
    fn = DIVERGENCES.get(loss_type)
    student_logp = student_log_probs(student_logits, teacher_ids, temperature=temperature)
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(
            f"student log-probs {tuple(student_logp.shape)} and teacher log-probs "
            f"{tuple(teacher_logp.shape)} differ in shape"
        )
    teacher_logp = teacher_logp.float()
    losses = fn(student_logp, teacher_logp, skew_alpha=skew_alpha, jsd_beta=jsd_beta)
    return losses * temperature**2, kl(teacher_logp, student_logp.detach())
