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
import torch.nn.functional as F

from roll_core.backends.train.base import is_max_metric
from roll_core.backends.train.lm_head import LMHead, as_head
from roll_core.backends.train.torch_backend import Objective, token_loss_sum
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.errors import ConfigError


def sft(head: LMHead | torch.Tensor, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean next-token cross-entropy on response tokens over the global batch."""
    ids, mask = mb.tensors["input_ids"], mb.tensors["loss_mask"]
    head = as_head(head)
    if head.project is None:  # the logits exist: the loss as it always was computed
        summed = token_loss_sum(head.hidden, ids, mask)
    else:
        picked = mask[:, 1:].bool()
        summed = head.map(picked, _cross_entropy, ids[:, 1:][picked])[0].sum()
    loss = summed / float(mb.meta["loss_tokens"])
    return loss, {
        "train/loss_sum": float(summed.detach()),
        "train/loss_tokens": float(mask[:, 1:].sum()),
    }


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    return (F.cross_entropy(logits.float(), targets, reduction="none"),)


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
    logits: LMHead | torch.Tensor,
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
    from roll_core.algorithms import policy_loss

    algo = algorithm
    t = mb.tensors
    mask = t["response_mask"]
    head = as_head(logits)
    offset = t["input_ids"].shape[1] - head.width
    picked = mask[:, offset:].bool()
    per_position = _response_terms(head, mb, picked, offset, algo, temperature, vocab_size)
    log_probs = _scatter(per_position["log_probs"], picked, offset, mask)
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
    kl_term, kl_metrics = _kl_term(log_probs, t, mask, algo, agg)
    if kl_term is not None:
        loss = loss + kl_term
        metrics |= kl_metrics
    if "divergence" in per_position:  # on-policy distillation, mode full
        term, distill_metrics = _full_distill_term(
            per_position["divergence"], picked, offset, mask, algo, agg
        )
        loss = loss + term
        metrics |= distill_metrics
    bonus, ent_metrics = _entropy_term(per_position["entropy"], picked, offset, mask, algo, agg)
    if bonus is not None:
        loss = loss + bonus
    metrics |= ent_metrics
    if "old_log_probs" not in t:  # the train/infer gap, measured on this forward instead
        metrics |= _train_infer_gap(old_log_probs, t["behaviour_log_probs"], mask)
    share = float(mask.sum()) / max(1.0, float(mb.meta["response_tokens"]))
    # means become this micro-batch's share of the global mean; maxima stay as they are, and
    # so do the loss terms, already this micro-batch's share (normalised by the global counts):
    # their sums are the mini-batch's, however its rows are grouped into micro-batches
    return loss, {
        k: float(v) * (1.0 if is_max_metric(k) or k in LOSS_SHARE_METRICS else share)
        for k, v in metrics.items()
    }


def _kl_term(
    log_probs: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    agg: dict[str, Any],
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The KL-to-reference loss term and its metrics when the recipe puts KL in the loss
    (``kl.use_as: loss``, ``kl.coef > 0``) and the batch has reference log-probs; else None."""
    from roll_core.algorithms import kl_loss

    kl = algo.kl
    if kl.coef > 0 and kl.use_as == "loss" and "ref_log_probs" in tensors:
        term, kl_metrics = kl_loss(
            log_probs=log_probs,
            ref_log_probs=tensors["ref_log_probs"],
            response_mask=mask,
            coef=kl.coef,
            estimator=kl.estimator,
            **agg,
        )
        return term, kl_metrics
    return None, {}


def _train_infer_gap(
    old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |train - inference| log-prob over the response tokens."""
    gap = (old_log_probs - behaviour_log_probs).abs()
    return {
        "train_infer/logprob_diff": float((gap * mask).sum() / mask.sum().clamp(min=1)),
        "train_infer/logprob_diff_max": float((gap * mask).max()) if gap.numel() else 0.0,
    }


def _response_terms(
    head: LMHead,
    mb: Batch,
    picked: torch.Tensor,
    offset: int,
    algo: AlgorithmConfig,
    temperature: float,
    vocab_size: int | None,
) -> dict[str, torch.Tensor]:
    """Per response position (``picked``: the mask from column ``offset`` on), in one pass
    over the logits, a chunk of positions at a time: ``log_probs`` (of the sampled tokens,
    at ``temperature``), ``entropy`` (with a graph only for an entropy bonus) and, for
    on-policy distillation's `mode: full`, the ``divergence`` of the student's distribution
    (cut to the tokenizer's ``vocab_size``) from the teacher's (``teacher_dist_*``).

    Only response positions carry a loss, so the output layer runs on those N positions,
    not on every prompt and padding position (N << B*T). A backend may compute the hidden
    states of the last columns only (`response_logits_from`): column j of `head` is then
    position `offset + j`; earlier positions carry no response."""
    from roll_core.algorithms import entropy_from_logits
    from roll_core.algorithms.on_policy_distill import full_divergence

    t = mb.tensors
    inputs = [t["input_ids"][:, 1 + offset :][picked]]
    distill = "teacher_dist_logprobs" in t
    teacher_ids = t.get("teacher_dist_ids")
    if distill:
        if vocab_size is None:
            raise RuntimeError("the rl objective got teacher distributions but no vocab_size")
        inputs.append(t["teacher_dist_logprobs"][:, offset:][picked])
        if teacher_ids is not None:
            inputs.append(teacher_ids[:, offset:][picked])
    opd = algo.on_policy_distill
    entropy_grad = algo.entropy_coef > 0

    def fn(logits: torch.Tensor, targets: torch.Tensor, *teacher: torch.Tensor) -> list[Any]:
        scaled = logits.float() / temperature
        logp = torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(scaled)
        out = [logp, entropy]
        if distill:
            assert opd is not None and vocab_size is not None
            out.append(
                full_divergence(
                    scaled,
                    teacher[0],
                    teacher[1] if len(teacher) > 1 else None,
                    vocab_size=vocab_size,
                    divergence=opd.divergence,
                )
            )
        return out

    values = head.map(picked, fn, *inputs)
    names = ["log_probs", "entropy", "divergence"][: len(values)]
    return dict(zip(names, values, strict=True))


def _entropy_term(
    entropy: torch.Tensor,
    picked: torch.Tensor,
    offset: int,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    agg: dict[str, Any],
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The entropy bonus (``algorithm.entropy_coef > 0``) of the response positions'
    entropies and its metric; else no term, and the metric of the entropies (computed
    without a graph)."""
    from roll_core.algorithms import entropy_bonus

    if algo.entropy_coef > 0:
        return entropy_bonus(
            entropy=_scatter(entropy, picked, offset, mask),
            response_mask=mask,
            coef=algo.entropy_coef,
            **agg,
        )
    ent_sum = (entropy * mask[:, offset:][picked]).sum()
    return None, {"actor/entropy": float(ent_sum / mask.sum().clamp(min=1))}


def _scatter(
    values: torch.Tensor, picked: torch.Tensor, offset: int, mask: torch.Tensor
) -> torch.Tensor:
    """Per-position values ``[N]`` of the positions ``picked`` (columns ``offset``..) laid out
    as ``mask`` ``[B, T-1]``, 0 elsewhere (autograd flows through)."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=mask.device)
    out[:, offset:] = out[:, offset:].masked_scatter(picked, values)
    return out


def _full_distill_term(
    per_position: torch.Tensor,
    picked: torch.Tensor,
    offset: int,
    mask: torch.Tensor,
    algo: AlgorithmConfig,
    agg: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, float]]:
    """`algorithm.on_policy_distill.mode: full`: coef x the exact divergence (reverse KL by
    default) of the student's next-token distributions to the teacher's, per response
    position (``per_position``, from :func:`_response_terms`), aggregated as the policy loss
    is."""
    from roll_core.algorithms import agg_loss

    opd = algo.on_policy_distill
    assert opd is not None
    term = opd.coef * agg_loss(
        _scatter(per_position, picked, offset, mask),
        mask,
        agg["agg_mode"],
        max_len=agg["max_len"],
        global_num_tokens=agg["global_num_tokens"],
        global_num_seqs=agg["global_num_seqs"],
    )
    mean = float(per_position.detach().sum() / mask.sum().clamp(min=1))
    return term, {"distill/full_divergence": mean, "actor/distill_loss": float(term.detach())}


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
