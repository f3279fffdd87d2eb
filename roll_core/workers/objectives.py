"""Training objectives: adapters from a micro-batch to the pure losses.

An objective is called by the train backend once per micro-batch with the logits and the
micro-batch, and returns (this micro-batch's share of the global loss, metric sums). Global
normalisers (e.g. `loss_tokens`, the trained tokens of the whole global batch across ranks)
travel in `batch.meta`, so gradient accumulation and data parallelism give the update of one
big batch. Workers pick objectives by name; they are the registry's only entries point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from roll_core.backends.train.base import is_max_metric
from roll_core.backends.train.torch_backend import LOG_PROB_CHUNK, Objective, token_loss_sum
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.errors import ConfigError


def sft(logits: torch.Tensor, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean next-token cross-entropy on response tokens over the global batch."""
    ids, mask = mb.tensors["input_ids"], mb.tensors["loss_mask"]
    summed = token_loss_sum(logits, ids, mask)
    loss = summed / float(mb.meta["loss_tokens"])
    return loss, {
        "train/loss_sum": float(summed.detach()),
        "train/loss_tokens": float(mask[:, 1:].sum()),
    }


OBJECTIVES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {"sft": sft}
"""Objective name -> function(logits, mb, **params). Pipelines add theirs here."""

from roll_core.workers.preference_objectives import PREFERENCE_OBJECTIVES  # noqa: E402

OBJECTIVES.update(PREFERENCE_OBJECTIVES)  # dpo, distill


def get_objective(name: str, **params: Any) -> Objective:
    """The objective `name` with its parameters bound."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}.")
    objective = functools.partial(OBJECTIVES[name], **params)
    if name == "rl":  # it reads response positions only: logits of earlier ones are not needed
        objective.logits_from = response_logits_from  # type: ignore[attr-defined]
    if name == "dpo":  # a micro-batch holds whole (chosen, rejected) pairs
        objective.rows_per_group = 2  # type: ignore[attr-defined]
    return objective


def rl(
    logits: torch.Tensor,
    mb: Batch,
    *,
    algorithm: AlgorithmConfig,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient objective of RLVR: the configured policy loss, plus KL and entropy
    terms when the recipe asks for them. ``vocab_size`` (on-policy distillation's `mode:
    full`): the tokenizer's size, the width of the teacher's distributions.

    Normalised with the mini-batch's global token and sequence counts in `mb.meta`, so
    micro-batching gives the mini-batch's loss; metrics are weighted by the micro-batch's share
    of the mini-batch's tokens, so their sums over micro-batches are mini-batch means (`*_max`
    metrics are maxima: left unweighted, combined by max).
    """
    from roll_core.algorithms import kl_loss, policy_loss

    algo = algorithm
    t = mb.tensors
    mask = t["response_mask"]
    scaled, picked, offset, log_probs = _response_log_probs(logits, mb, temperature)
    loss_kwargs = algo.policy_loss_kwargs(max_len=int(mb.meta["max_response_length"]))
    globals_ = {
        "global_num_tokens": mb.meta["response_tokens"],
        "global_num_seqs": mb.meta["sequences"],
    }
    agg = {"agg_mode": loss_kwargs["agg_mode"], "max_len": loss_kwargs["max_len"], **globals_}
    # One update on on-policy samples (rlvr's `trainer.old_log_probs: auto`): the old policy is
    # this very forward, so its detached log-probs are the old log-probs, bit for bit.
    old_log_probs = t["old_log_probs"] if "old_log_probs" in t else log_probs.detach()
    loss, metrics = policy_loss(
        algo.policy_loss,
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=t["advantages"],
        response_mask=mask,
        infer_log_probs=t["behaviour_log_probs"],
        rollout_is_weights=t.get("rollout_is_weights"),
        **loss_kwargs,
        **globals_,
    )
    kl = algo.kl
    if kl.coef > 0 and kl.use_as == "loss" and "ref_log_probs" in t:
        term, kl_metrics = kl_loss(
            log_probs=log_probs,
            ref_log_probs=t["ref_log_probs"],
            response_mask=mask,
            coef=kl.coef,
            estimator=kl.estimator,
            **agg,
        )
        loss = loss + term
        metrics |= kl_metrics
    if "teacher_dist_logprobs" in t:  # on-policy distillation, mode full
        if vocab_size is None:
            raise RuntimeError("the rl objective got teacher distributions but no vocab_size")
        term, distill_metrics = _full_distill_term(
            scaled, picked, offset, mb, algo, agg, vocab_size=vocab_size
        )
        loss = loss + term
        metrics |= distill_metrics
    bonus, ent_metrics = _entropy_term(scaled, picked, offset, mask, algo.entropy_coef, agg)
    if bonus is not None:
        loss = loss + bonus
    metrics |= ent_metrics
    if "old_log_probs" not in t:  # the train/infer gap, measured on this forward instead
        gap = (old_log_probs - t["behaviour_log_probs"]).abs()
        metrics["train_infer/logprob_diff"] = float((gap * mask).sum() / mask.sum().clamp(min=1))
        metrics["train_infer/logprob_diff_max"] = float((gap * mask).max()) if gap.numel() else 0.0
    share = float(mask.sum()) / max(1.0, float(mb.meta["response_tokens"]))
    # means become this micro-batch's share of the global mean; maxima stay as they are, and
    # so do the loss terms, already this micro-batch's share (normalised by the global counts):
    # their sums are the mini-batch's, however its rows are grouped into micro-batches
    return loss, {
        k: float(v) * (1.0 if is_max_metric(k) or k in LOSS_SHARE_METRICS else share)
        for k, v in metrics.items()
    }


def _entropy_term(
    scaled: torch.Tensor,
    picked: torch.Tensor,
    offset: int,
    mask: torch.Tensor,
    coef: float,
    agg: dict[str, Any],
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The entropy bonus (``coef > 0``) and its metrics; else no term, and the entropy metric
    computed without a graph, a chunk of rows at a time (softmax copies stay small)."""
    from roll_core.algorithms import entropy_bonus, entropy_from_logits

    if coef > 0:
        ent = torch.zeros(mask.shape, dtype=scaled.dtype, device=mask.device)
        ent[:, offset:] = ent[:, offset:].masked_scatter(picked, entropy_from_logits(scaled))
        return entropy_bonus(entropy=ent, response_mask=mask, coef=coef, **agg)
    with torch.no_grad():
        step = max(1, LOG_PROB_CHUNK // max(1, scaled.shape[-1]))
        ent = torch.cat([entropy_from_logits(c) for c in scaled.split(step)])
        ent_sum = (ent * mask[:, offset:][picked]).sum()
        return None, {"actor/entropy": float(ent_sum / mask.sum().clamp(min=1))}


def _full_distill_term(
    scaled: torch.Tensor,
    picked: torch.Tensor,
    offset: int,
    mb: Batch,
    algo: AlgorithmConfig,
    agg: dict[str, Any],
    *,
    vocab_size: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`algorithm.on_policy_distill.mode: full`: coef x the exact divergence (reverse KL by
    default) of the student's next-token distributions (``scaled``: the response positions'
    logits / temperature, cut to the tokenizer's ``vocab_size`` as the teacher's were) to the
    teacher's (``teacher_dist_*`` of the batch), aggregated as the policy loss is."""
    from roll_core.algorithms import agg_loss
    from roll_core.algorithms.on_policy_distill import full_divergence

    t = mb.tensors
    mask = t["response_mask"]
    ids = t.get("teacher_dist_ids")
    opd = algo.on_policy_distill
    assert opd is not None
    per_position = full_divergence(
        scaled,
        t["teacher_dist_logprobs"][:, offset:][picked],
        ids[:, offset:][picked] if ids is not None else None,
        vocab_size=vocab_size,
        divergence=opd.divergence,
    )
    loss_mat = torch.zeros(mask.shape, dtype=per_position.dtype, device=mask.device)
    loss_mat[:, offset:] = loss_mat[:, offset:].masked_scatter(picked, per_position)
    term = opd.coef * agg_loss(
        loss_mat,
        mask,
        agg["agg_mode"],
        max_len=agg["max_len"],
        global_num_tokens=agg["global_num_tokens"],
        global_num_seqs=agg["global_num_seqs"],
    )
    mean = float(per_position.detach().sum() / mask.sum().clamp(min=1))
    return term, {"distill/full_divergence": mean, "actor/distill_loss": float(term.detach())}


def _response_log_probs(
    logits: torch.Tensor, mb: Batch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(scaled logits of the N response positions [N, V], which positions those are, the
    column offset of `logits`, log-probs [B, T-1] with 0 off the responses).

    Only response positions carry a loss: the softmax over the vocabulary (and the entropy)
    is computed on those N rows, not on every prompt and padding position ([N, V], N << B*T).
    A backend may compute the logits of the last columns only (`response_logits_from`):
    column j of `logits` is then position `offset + j`; earlier positions carry no response."""
    t = mb.tensors
    mask = t["response_mask"]
    offset = t["input_ids"].shape[1] - logits.shape[1]
    picked = mask[:, offset:].bool()
    scaled = logits[:, :-1][picked].float() / temperature  # [N, V]
    targets = t["input_ids"][:, 1 + offset :][picked]
    picked_log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    log_probs = torch.zeros(mask.shape, dtype=picked_log_probs.dtype, device=mask.device)
    log_probs[:, offset:] = log_probs[:, offset:].masked_scatter(picked, picked_log_probs)
    return scaled, picked, offset, log_probs


LOSS_SHARE_METRICS = frozenset({"actor/pg_loss", "actor/kl_loss", "actor/distill_loss"})
"""Metrics of `rl` that are the micro-batch's share of a global loss term (not means over
the micro-batch): summed over micro-batches as they are."""


def response_logits_from(mb: Batch) -> int:
    """The first input column whose logits the RL objective reads: the first target column
    with a response token (targets are shifted by one, so target column t is input column t).
    Backends that can (torch) compute the logits from there on only (`logits_to_keep`)."""
    columns = mb.tensors["response_mask"].any(0).nonzero()
    return int(columns[0]) if len(columns) else 0


OBJECTIVES["rl"] = rl
