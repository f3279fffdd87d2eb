"""Pairwise preference losses: DPO (sigmoid), IPO and conservative DPO.

Every loss is a function of the *log-ratio difference* of a pair (chosen ``w``, rejected ``l``)::

    h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))

where ``log pi(y|x)`` is the policy's log-probability of the whole response (the sum over its
tokens) and ``ref`` the frozen reference policy (the starting model).

* ``sigmoid``: DPO, Rafailov et al. 2023 (arXiv 2305.18290), eq. 7: ``-log sigmoid(beta h)``.
* ``cdpo``: conservative DPO, Mitchell 2023 ("A note on DPO with noisy preferences"): the
  labels are assumed flipped with probability ``eps = label_smoothing``:
  ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
* ``ipo``: IPO, Azar et al. 2023 (arXiv 2310.12036), eq. 17: ``(h - 1 / (2 beta))^2``.
  Departure: the paper's log-likelihoods are sums over tokens and so are ours; TRL averages
  them over tokens for IPO. With sums a long response can move h more per token.

The implicit rewards are ``r_w = beta (log pi(y_w) - log ref(y_w))`` and likewise ``r_l``; a
pair counts as correctly ranked when ``r_w > r_l`` (``h > 0``). At initialisation (pi = ref)
every reward is 0, every loss is its value at h = 0 and no pair counts as correctly ranked.

Shapes: every input is ``[B]`` (one entry per pair); outputs are ``[B]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from roll_core.algorithms.registry import Registry

PREFERENCE_LOSSES: Registry = Registry("preference loss", key="dpo.loss")
"""Loss name -> ``fn(h [B], *, beta, label_smoothing) -> per-pair loss [B]``."""


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid_loss(h: torch.Tensor, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO: ``-log sigmoid(beta h)`` per pair (``label_smoothing`` must be 0)."""
    if label_smoothing:
        raise ValueError("the sigmoid loss takes no label_smoothing; use cdpo")
    return -F.logsigmoid(beta * h)


@PREFERENCE_LOSSES.register("cdpo")
def cdpo_loss(h: torch.Tensor, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Conservative DPO: the DPO loss against labels flipped with probability eps."""
    eps = label_smoothing
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(h: torch.Tensor, *, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO: ``(h - 1 / (2 beta))^2`` per pair: regresses the log-ratio gap onto 1 / (2 beta)."""
    if label_smoothing:
        raise ValueError("the ipo loss takes no label_smoothing")
    return (h - 1.0 / (2.0 * beta)) ** 2


class PreferenceOutput(NamedTuple):
    """Per-pair results of :func:`preference_loss`, each ``[B]``."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """Per-pair loss and implicit rewards (rewards are detached: they are metrics).

    Args:
        policy_chosen_logps: ``[B]`` summed log-probs of the chosen responses under the policy.
        policy_rejected_logps: ``[B]`` the same for the rejected responses.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` the same under the reference policy.
        loss_type: a name in :data:`PREFERENCE_LOSSES` (``sigmoid``, ``ipo``, ``cdpo``).
        beta: strength of the implicit KL constraint to the reference (> 0).
        label_smoothing: ``cdpo`` only: the assumed probability of a flipped label, in [0, 0.5).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_logratios = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected_logratios = policy_rejected_logps.float() - ref_rejected_logps.float()
    h = chosen_logratios - rejected_logratios
    fn = PREFERENCE_LOSSES.get(loss_type)
    losses = fn(h, beta=beta, label_smoothing=label_smoothing)
    return PreferenceOutput(
        losses=losses,
        chosen_rewards=beta * chosen_logratios.detach(),
        rejected_rewards=beta * rejected_logratios.detach(),
    )


def chosen_nll(policy_chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of each chosen response, ``[B]``: the term RPO
    (Pang et al. 2024, arXiv 2404.19733, eq. 2) adds to DPO, weighted by ``alpha``, so the
    chosen responses do not lose likelihood while the margin grows.

    Args:
        policy_chosen_logps: ``[B]`` summed log-probs of the chosen responses.
        chosen_tokens: ``[B]`` number of scored tokens of each chosen response (>= 1).
    """
    return -policy_chosen_logps.float() / chosen_tokens.float()
