"""The tensor steps of an RL iteration between rollout and update: token rewards, KL in the
reward, advantages, and the batch metrics. Thin glue over the pure functions in algorithms/."""

from __future__ import annotations

from typing import Any

import torch

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


def advantages_and_kl(
    batch: Batch, algo: AlgorithmConfig, kl_state: dict[str, Any]
) -> dict[str, float]:
    """Fill `batch.tensors["advantages"]` (and `returns`) from the scores; KL-in-reward if set."""
    from roll_core.algorithms import compute_advantages, kl_penalty, shape_rewards

    t = batch.tensors
    mask = t["response_mask"]
    scores = shape_rewards(t["scores"], group_ids=t["group_ids"], config=algo)
    token_rewards = torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)  # last response position
    token_rewards[torch.arange(len(batch)), last] = scores
    metrics: dict[str, float] = {}
    if algo.kl.coef > 0 and algo.kl.use_as == "reward" and "ref_log_probs" in t:
        kl = kl_penalty(t["old_log_probs"], t["ref_log_probs"], estimator=algo.kl.estimator) * mask
        token_rewards = token_rewards - kl_state["coef"] * kl
        metrics["actor/kl_reward"] = _masked_mean(kl, mask)
        metrics["actor/kl_coef"] = float(kl_state["coef"])
    advantages, returns = compute_advantages(
        algo.adv_estimator,
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=t["group_ids"],
        config=algo,
    )
    t["advantages"], t["returns"] = advantages, returns
    metrics["actor/advantage_mean"] = _masked_mean(advantages, mask)
    metrics["actor/advantage_abs_max"] = float((advantages.abs() * mask).max())
    return metrics
