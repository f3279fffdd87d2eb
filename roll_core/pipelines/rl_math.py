"""The tensor steps of an RL iteration between rollout and update: reward shaping, KL in the
reward, advantages, and batch metrics. Thin glue over the pure functions in algorithms/.

All per-token tensors are in the batch's target space [B, T-1] (see rollout/batch.py).
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.algorithms import (
    RunningMeanStd,
    apply_kl_penalty,
    clip_advantages,
    clip_rewards,
    compute_advantages,
    explained_variance,
    normalize_rewards,
    overlong_penalty,
    scores_to_token_rewards,
    whiten_advantages,
)
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def rl_batch_metrics(batch: Batch, max_new_tokens: int) -> dict[str, float]:
    """Rewards, response lengths and the train/infer log-prob gap of a rollout batch."""
    t = batch.tensors
    lengths = t["response_lengths"].float()
    mask = t["response_mask"]
    metrics = {
        "rollout/reward_mean": float(t["scores"].mean()),
        "rollout/reward_std": float(t["scores"].std()) if len(batch) > 1 else 0.0,
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_clip_ratio": float((lengths >= max_new_tokens).float().mean()),
    }
    if "old_log_probs" in t:
        gap = (t["old_log_probs"] - t["behaviour_log_probs"]).abs()
        metrics["train_infer/logprob_diff"] = _masked_mean(gap, mask)
        metrics["train_infer/logprob_diff_max"] = float((gap * mask).max())
    return metrics


def critic_batch_metrics(batch: Batch) -> dict[str, float]:
    """The critic's predictions on a rollout batch against the returns computed from them
    (before the critic's update): their mean and the explained variance."""
    t = batch.tensors
    mask = t["response_mask"]
    return {
        "critic/values_mean": _masked_mean(t["values"], mask),
        "critic/returns_mean": _masked_mean(t["returns"], mask),
        "critic/explained_variance": float(
            explained_variance(values=t["values"], returns=t["returns"], response_mask=mask)
        ),
    }


class RLState:
    """What the reward/advantage steps carry across iterations (checkpointed)."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        from roll_core.algorithms import make_kl_controller

        self.kl = make_kl_controller(
            coef=algo.kl.coef, target=algo.kl.target, horizon=algo.kl.horizon
        )
        self.running = RunningMeanStd()

    def state_dict(self) -> dict[str, Any]:
        return {"kl": self.kl.state_dict(), "running": self.running.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl.load_state_dict(state["kl"])
        self.running.load_state_dict(state["running"])


def advantages_and_kl(
    batch: Batch, algo: AlgorithmConfig, state: RLState, *, max_new_tokens: int
) -> dict[str, float]:
    """Fill `advantages` and `returns` [B, T-1] from the scores (+ KL in the reward if set)."""
    t = batch.tensors
    mask = t["response_mask"]
    scores = t["scores"]
    metrics: dict[str, float] = {}
    if algo.overlong.mode == "penalty":
        buffer = algo.overlong.resolved_buffer_len(max_new_tokens)
        penalty = overlong_penalty(
            response_lengths=t["response_lengths"],
            max_len=max_new_tokens,
            buffer_len=buffer,
            factor=algo.overlong.penalty_factor,
        )
        scores = scores + penalty
        metrics["rollout/overlong_penalty_mean"] = float(penalty.mean())
    if algo.overlong.mode == "filter":
        truncated = t["response_lengths"] >= max_new_tokens
        mask = mask * (~truncated).float().unsqueeze(1)
        t["response_mask"] = mask
    scores = normalize_rewards(
        algo.reward.normalize, scores=scores, group_ids=t["group_ids"], running=state.running
    )
    scores = clip_rewards(scores, algo.reward.clip)
    token_rewards = scores_to_token_rewards(scores, mask)
    if algo.kl.coef > 0 and algo.kl.use_as == "reward" and "ref_log_probs" in t:
        token_rewards, kl_metrics = apply_kl_penalty(
            token_scores=token_rewards,
            log_probs=t["old_log_probs"],
            ref_log_probs=t["ref_log_probs"],
            response_mask=mask,
            coef=state.kl.value,
            estimator=algo.kl.estimator,
        )
        metrics |= kl_metrics
        state.kl.update(kl_metrics["actor/reward_kl"], len(batch))
    advantages, returns = compute_advantages(
        algo.adv_estimator,
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=t["group_ids"],
        values=t.get("values"),
        gamma=algo.gamma,
        lam=algo.lam,
        eps=algo.adv_eps,
        norm_adv_by_std=algo.norm_adv_by_std,
    )
    if algo.advantage.whiten:
        advantages = whiten_advantages(advantages, mask)
    advantages = clip_advantages(advantages, algo.advantage.clip)
    t["advantages"], t["returns"] = advantages * mask, returns * mask
    metrics["actor/advantage_mean"] = _masked_mean(advantages, mask)
    metrics["actor/advantage_abs_max"] = float((advantages.abs() * mask).max())
    return metrics
