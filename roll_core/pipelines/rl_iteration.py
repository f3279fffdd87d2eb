"""The parts of one RL iteration after its rollout (pipelines/rl_loop.py runs them in
order): the reference and old log-probs, reward shaping and KL in the reward, advantages,
rollout correction, the ppo_epochs x mini_batches update, and the batch metrics. Thin glue
over the pure functions in algorithms/ and the roles built by roles.py (`RLRoles`); typed on
`RLConfig`, the base of both pipelines' configs.

All per-token tensors are in the batch's target space [B, T-1] (see rollout/batch.py).
"""

from __future__ import annotations

import time
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
    rollout_correction,
    scores_to_token_rewards,
    whiten_advantages,
)
from roll_core.backends.infer import SamplingParams
from roll_core.backends.train.base import is_max_metric
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.rlvr import RLConfig, SamplingConfig
from roll_core.data import Batch
from roll_core.pipelines.roles import RLRoles


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


def correct_rollout(batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
    """`algorithm.rollout_correction` on a rollout batch, after its advantages and before
    the update: puts the importance weights into `rollout_is_weights` (the policy loss
    multiplies each token's loss by them) and removes rejected tokens from `response_mask`
    (so they leave the KL and entropy terms, the critic's loss and every loss denominator).
    After the advantages, so that a rejected last token does not move its response's score
    (placed on the last response token) out of the group baselines: as in verl, whose rewards
    are placed before the rejection. Returns the `rollout_corr/...` metrics, computed once over
    the whole batch. Needs `old_log_probs` (see :func:`reuses_update_log_probs`)."""
    rc = algo.rollout_correction
    if rc is None:
        return {}
    t = batch.tensors
    weights, mask, metrics = rollout_correction(
        old_log_probs=t["old_log_probs"],
        rollout_log_probs=t["behaviour_log_probs"],
        response_mask=t["response_mask"],
        **rc.kwargs(),
    )
    t["response_mask"] = mask
    if weights is not None:
        t["rollout_is_weights"] = weights
    return metrics


def logprob_gap_warning(metrics: dict[str, float], threshold: float | None) -> str | None:
    """The warning for a step whose `train_infer/logprob_diff` exceeds `threshold`
    (`trainer.warn_logprob_diff`; None: never), or None."""
    gap = metrics.get("train_infer/logprob_diff")
    if threshold is None or gap is None or not gap > threshold:
        return None
    worst = metrics.get("train_infer/logprob_diff_max")
    return (
        f"train_infer/logprob_diff is {gap:.3g}"
        + (f" (max {worst:.3g})" if worst is not None else "")
        + f", above trainer.warn_logprob_diff={threshold:g}: the trainer's log-probs of the "
        "sampled tokens differ from the inference engine's by more than numerics explain "
        "(fp32: ~1e-6, bf16 engines: ~1e-3), so the updates are off-policy. Common causes: a "
        "mixture-of-experts model whose routing differs between the engine and the trainer "
        "(e.g. Qwen3-MoE on vLLM vs the HF forward; algorithm.router_replay: r3 replays the "
        "sampler's routes with the hf engine), different precisions (actor_infer."
        "precision, vllm.dtype), or weights that did not sync. To correct for it set "
        "algorithm.rollout_correction (e.g. preset: token_tis, the same as algorithm.tis_cap: "
        "2, or k3_rs_token_tis to also reject the most divergent responses; docs/algorithms.md) "
        "or algorithm.policy_loss: decoupled_ppo; to silence this, raise trainer.warn_logprob_diff (null: never). "
        "Shown once per run."
    )


def warn_logprob_gap(
    loop: Any, state: RLState, metrics: dict[str, float], threshold: float | None
) -> None:
    """Print :func:`logprob_gap_warning` on the run's console, the first time only."""
    if state.gap_warned:
        return
    message = logprob_gap_warning(metrics, threshold)
    if message is not None:
        state.gap_warned = True
        loop.console.print(f"warning: {message}", style="yellow", markup=False, soft_wrap=True)


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
        self.gap_warned = False  # train/infer log-prob gap warned (once per run, not saved)

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
    once = _episode_rows(t, algo)
    if once is not None:  # an agent episode of k segments counts once in its group
        first, inverse = once
        episode_scores = normalize_rewards(
            algo.reward.normalize,
            scores=scores[first],
            group_ids=t["group_ids"][first],
            running=state.running,
        )
        scores = clip_rewards(episode_scores, algo.reward.clip)[inverse]
    else:
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
        **algo.advantage_kwargs(),
    )
    if once is not None:
        advantages = _per_episode_advantages(algo, token_rewards, mask, t["group_ids"], once)
    if algo.advantage.whiten:
        advantages = whiten_advantages(advantages, mask)
    advantages = clip_advantages(advantages, algo.advantage.clip)
    t["advantages"], t["returns"] = advantages * mask, returns * mask
    metrics["actor/advantage_mean"] = _masked_mean(advantages, mask)
    metrics["actor/advantage_abs_max"] = float((advantages.abs() * mask).max())
    return metrics


ONCE_PER_EPISODE = frozenset({"grpo", "dr_grpo", "rloo"})
"""Group estimators whose advantage is one number per response: with agent segments, each
episode counts once in its group's statistics and every segment gets the episode's number."""


def _episode_rows(t: dict[str, torch.Tensor], algo: AlgorithmConfig) -> Any:
    """``(first row of each episode, episode of each row)`` when rows are segments of agent
    episodes (``episode_ids`` with repeats) and the estimator works on one number per response
    (:data:`ONCE_PER_EPISODE`, no per-row KL or length penalty in the score); else None."""
    episodes = t.get("episode_ids")
    if episodes is None or algo.adv_estimator not in ONCE_PER_EPISODE:
        return None
    if (algo.kl.coef > 0 and algo.kl.use_as == "reward") or algo.overlong.mode == "penalty":
        return None
    unique, inverse = torch.unique(episodes, return_inverse=True)
    if len(unique) == len(episodes):
        return None
    rows = torch.arange(len(episodes), device=episodes.device)
    first = torch.full((len(unique),), len(episodes), dtype=torch.long, device=episodes.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _per_episode_advantages(
    algo: AlgorithmConfig,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    once: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The estimator on one row per episode (its group statistics over episodes, not over
    segments), each segment row getting its episode's advantage."""
    first, inverse = once
    adv, _ = compute_advantages(
        algo.adv_estimator,
        token_rewards=token_rewards[first],
        response_mask=mask[first],
        group_ids=group_ids[first],
        **algo.advantage_kwargs(),
    )
    m = mask[first].to(adv.dtype)
    per_episode = (adv * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_episode[inverse].unsqueeze(-1) * mask.to(adv.dtype)


def sampling_params(rollout: SamplingConfig) -> SamplingParams:
    """How training rollouts sample (`rollout.max_new_tokens`, temperature, top-p/k, stop)."""
    r = rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop=tuple(r.stop),
    )


def record_weight_sync(roles: RLRoles, loop: Any) -> None:
    """The path the first sync took (decided from where the ranks really run, which the dry
    run can only plan): one console line, and ``weight_sync`` in the run's meta.json
    (path, what sync.path asked for, group backend, ranks, bucket size; docs/scaling.md)."""
    info = roles.weight_sync.describe()
    loop.run.update_meta(weight_sync=info)
    shared = "the engine reads the trainer's parameters, one model in memory"
    how = {
        "same_process": shared if info.get("shared") else "in-place copies",
        "driver": "rank 0 gathers every weight, the driver sends them",
    }.get(info["path"], f"{info['backend']} group of {info['ranks']} ranks")
    loop.console_note(
        f"weight sync: {info['path']} ({how}; sync.path={info['requested']}, "
        f"buckets of {info['bucket_mb']:g} MiB)"
    )


def reuses_update_log_probs(cfg: RLConfig) -> bool:
    """True when the step's one update may compute the old log-probs itself (the detached
    log-probs of its own forward, workers/objectives.py): one update per step, no KL in
    the reward and no rollout correction (they read them before the update). The pipelines also ask actor_train whether
    its model has active dropout (then the train-mode forward differs from the old-log-prob
    one)."""
    t, algo = cfg.trainer, cfg.algorithm
    return (
        t.old_log_probs == "auto"
        and t.ppo_epochs == 1
        and t.mini_batches == 1
        and not (algo.kl.coef > 0 and algo.kl.use_as == "reward")
        and algo.rollout_correction is None  # it weighs pi_old against pi_rollout before
        and algo.on_policy_distill is None  # the student's log-probs enter the advantage
    )


def add_policy_log_probs(
    roles: RLRoles, batch: Batch, temperature: float, *, old: bool = True
) -> dict[str, float]:
    """Put the reference model's (when there is one) and, unless `old` is False, the current
    policy's log-probs of the rollout tokens into `batch` (`ref_log_probs`, `old_log_probs`);
    returns their timings."""
    timers: dict[str, float] = {}
    if roles.reference is not None:
        t = time.perf_counter()
        batch.tensors["ref_log_probs"] = roles.reference.log_probs(batch, temperature=temperature)
        timers["time/reference"] = time.perf_counter() - t
    if not old:
        return timers
    t = time.perf_counter()
    batch.tensors["old_log_probs"] = roles.actor_train.log_probs(batch, temperature=temperature)
    timers["time/old_log_prob"] = time.perf_counter() - t
    return timers


def add_values(roles: RLRoles, batch: Batch) -> dict[str, float]:
    """The critic's values of the rollout tokens (`values`, masked to the response), when
    there is a critic; returns their timing."""
    if roles.critic is None:
        return {}
    t = time.perf_counter()
    batch.tensors["values"] = roles.critic.values(batch) * batch.tensors["response_mask"]
    return {"time/values": time.perf_counter() - t}


def mini_batch_meta(mb: Batch, *, max_response_length: int) -> dict[str, float]:
    """The global counts every micro-batch of mini-batch `mb` normalises its loss by: response
    tokens, sequences (rows with at least one response token: a row whose response is masked
    out, e.g. by `overlong.mode: filter`, is no sequence, as in `agg_loss`) and the length
    limit of `seq-mean-token-sum-norm`."""
    mask = mb.tensors["response_mask"]
    return {
        "response_tokens": float(mask.sum()),
        "sequences": float((mask.sum(dim=-1) > 0).sum()),
        "max_response_length": float(max_response_length),
    }


def update_policy(
    cfg: RLConfig, roles: RLRoles, batch: Batch, temperature: float
) -> dict[str, float]:
    """ppo_epochs x mini_batches optimizer steps (of the critic, when there is one, then of
    the actor, on the same mini-batch); metrics averaged over them (`*_max`: the largest)."""
    totals: dict[str, float] = {}
    count = 0
    algo = cfg.algorithm
    vocab = batch.meta.get("vocab_size")  # mode full's teacher distributions: their width
    for epoch in range(cfg.trainer.ppo_epochs):
        order = torch.randperm(
            len(batch), generator=torch.Generator().manual_seed(cfg.seed + epoch)
        )
        shuffled = batch.select(order) if cfg.trainer.mini_batches > 1 else batch
        for mb in shuffled.split(cfg.trainer.mini_batches):
            mb.meta = mini_batch_meta(mb, max_response_length=cfg.rollout.max_new_tokens)
            step_metrics: dict[str, float] = {}
            if roles.critic is not None:
                step_metrics |= roles.critic.train_step(mb)  # ranks' metrics reduced
            step_metrics |= roles.actor_train.train_step(
                mb, objective="rl", algorithm=algo, temperature=temperature, vocab_size=vocab
            )
            for k, v in step_metrics.items():
                if is_max_metric(k):
                    totals[k] = max(totals.get(k, v), v)
                else:
                    totals[k] = totals.get(k, 0.0) + v
            count += 1
    return {k: v if is_max_metric(k) else v / count for k, v in totals.items()}
