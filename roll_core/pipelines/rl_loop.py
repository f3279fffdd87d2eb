"""The one RL loop of `roll train rlvr` and `roll train agentic`.

Both pipelines build their roles (pipelines/roles.py `RLRoles`) and their rollout source
(rollout/source.py: the RLVR schedulers, the agentic env manager), register what else they
checkpoint with the DriverLoop, and call :func:`run_rl`. The loop's pseudo-code, with the
turns colocated roles take around it, is in docs/internals.md ("The loop"): its one copy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from roll_core.config.rlvr import RLConfig
from roll_core.data import Batch
from roll_core.pipelines.common import DriverLoop
from roll_core.pipelines.rl_iteration import (
    RLState,
    add_policy_log_probs,
    add_values,
    advantages_and_kl,
    correct_rollout,
    critic_batch_metrics,
    record_weight_sync,
    reuses_update_log_probs,
    rl_batch_metrics,
    update_policy,
    warn_logprob_gap,
)
from roll_core.pipelines.rl_records import RolloutRecorder
from roll_core.pipelines.roles import RLRoles
from roll_core.rollout.source import RolloutSource

Advantages = Callable[[Batch, RLState], dict[str, float]]
"""Fills `advantages` and `returns` of a rollout batch; returns its metrics."""


@dataclass
class RLHooks:
    """What a pipeline adds to the loop.

    * ``evaluate``: validation (held-out prompts or env seeds), at the schedule's steps;
    * ``eval_at_start``: also before step 1 of a fresh run;
    * ``advantages``: how the batch gets its advantages (None: the estimator of
      `algorithm.adv_estimator` with KL in the reward, :func:`advantages_and_kl`);
    * ``before_first_sync``: called with the start step after the checkpoint is restored
      and before the first weight sync (agentic: the warm start);
    * ``tokenizer``: decodes the rollout records' tokens (`tracking.rollout_records`; None:
      the records show token ids).
    """

    evaluate: Callable[[], dict[str, float]] | None = None
    eval_at_start: bool = False
    advantages: Advantages | None = None
    before_first_sync: Callable[[int], None] | None = None
    tokenizer: Any = None


def run_rl(
    cfg: RLConfig, roles: RLRoles, source: RolloutSource, loop: DriverLoop, hooks: RLHooks
) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns the final metrics.
    The caller has registered its own checkpoint parts; the roles, the RL state and the
    source are registered here."""
    rl_state = RLState(cfg.algorithm)
    reuse = reuses_update_log_probs(cfg) and not any(roles.actor_train.has_dropout())
    loop.register("roles", roles)
    loop.register("rl", rl_state)
    loop.register("rollout", source)
    start = loop.begin()
    records = _recorder(cfg, loop, hooks, start)
    if hooks.before_first_sync is not None:
        hooks.before_first_sync(start)
    with source.paused(start):
        roles.sync(start)
    record_weight_sync(roles, loop)
    roles.turns.start()
    if hooks.evaluate is not None and hooks.eval_at_start and start == 0:
        loop.log_eval(0, hooks.evaluate)
    evaluate = hooks.evaluate
    for step in loop.steps(start, cfg.trainer.max_steps):
        one_step = functools.partial(
            rl_step, cfg, roles, source, step, rl_state, hooks, reuse, records
        )
        metrics = logging_faults(loop, step, one_step)
        if records is not None and records.store.full and not records.budget_noted:
            records.budget_noted = True
            budget = cfg.tracking.rollout_records.max_mb
            loop.console_note(
                f"rollout records: tracking.rollout_records.max_mb={budget:g} is spent; steps "
                f"from {step} on are not recorded (roll view shows the steps before)"
            )
        warn_logprob_gap(loop, rl_state, metrics, cfg.trainer.warn_logprob_diff)
        metrics |= source.metrics()
        # version v = the weights after v updates; async: suspend -> sync -> resume;
        # colocated: optimizer off, inference weights back, sync, params off, KV back
        with source.paused(step) as paused:
            metrics |= roles.turns.sync(functools.partial(roles.sync, step))()
        metrics |= paused
        loop.end_step(step, metrics, evaluate=(lambda s: evaluate()) if evaluate else None)
    return loop.finish(export=roles.export)


def rl_step(
    cfg: RLConfig,
    roles: RLRoles,
    source: RolloutSource,
    step: int,
    rl_state: RLState,
    hooks: RLHooks,
    reuse_log_probs: bool = False,
    records: RolloutRecorder | None = None,
) -> dict[str, float]:
    """One step up to the weight sync: rollout -> batch -> log-probs -> advantages ->
    update; returns the step's metrics. `records`: the rollout record, written before the
    update (the trainer's log-probs are the pre-update policy's)."""
    timers: dict[str, float] = {}
    t = step_start = time.perf_counter()
    rollout = source.next_batch(step)
    timers["time/rollout"] = time.perf_counter() - t
    if roles.turns.active:
        source.hold()  # nothing generates while the engine is offloaded
    roles.turns.to_train()  # colocated: inference frees its memory, training state back
    batch = source.to_batch(rollout.groups)
    temp = cfg.rollout.temperature or 1.0
    timers |= add_policy_log_probs(roles, batch, temp, old=not reuse_log_probs)
    timers |= add_values(roles, batch)
    if hooks.advantages is not None:
        metrics = hooks.advantages(batch, rl_state)
    else:
        max_new = cfg.rollout.max_new_tokens
        metrics = advantages_and_kl(batch, cfg.algorithm, rl_state, max_new_tokens=max_new)
    metrics |= correct_rollout(batch, cfg.algorithm)
    if roles.critic is not None:
        metrics |= critic_batch_metrics(batch)
    if records is not None:
        t = time.perf_counter()
        records.record(step, batch, rollout.groups, trainer_log_probs=_log_probs(roles, temp))
        timers["time/records"] = time.perf_counter() - t
    t = time.perf_counter()
    metrics |= update_policy(cfg, roles, batch, temp)
    timers["time/train"] = time.perf_counter() - t
    timers |= _perf(batch, time.perf_counter() - step_start, timers["time/rollout"])
    return {
        **rollout.metrics,
        **rl_batch_metrics(batch, cfg.rollout.max_new_tokens),
        **metrics,
        **timers,
    }


def _recorder(
    cfg: RLConfig, loop: DriverLoop, hooks: RLHooks, start: int
) -> RolloutRecorder | None:
    """The run's rollout record (`tracking.rollout_records`), continued after `start`."""
    rc = cfg.tracking.rollout_records
    if not rc.enabled:
        return None
    return RolloutRecorder(rc, loop.run.dir, tokenizer=hooks.tokenizer, start=start)


def _log_probs(roles: RLRoles, temperature: float) -> Callable[[Batch], Any]:
    """For the record: the trainer's log-probs (used when the update computes the batch's
    own) and entropies of its few rows, or None when they are fewer than actor_train's ranks
    (each needs a row)."""
    ranks = int(getattr(roles.actor_train, "world_size", 1))

    def log_probs(sub: Batch) -> Any:
        if len(sub) < ranks:
            return None
        return roles.actor_train.token_stats(sub, temperature=temperature)

    return log_probs


def _perf(batch: Batch, wall: float, rollout_s: float) -> dict[str, float]:
    """The step's throughput: wall time, samples, tokens/s overall and generated."""
    generated = float(batch.tensors["response_lengths"].sum())
    return {
        "perf/step_s": wall,
        "perf/samples": float(len(batch)),
        # CPU seconds this process has used so far (every role under executor: local); the
        # difference between two steps is, on a shared machine, a steadier measure than wall
        "perf/process_cpu_total_s": time.process_time(),
        "perf/tokens_per_s": float(batch.tensors["attention_mask"].sum()) / wall,
        "perf/generated_tokens_per_s": generated / max(1e-9, rollout_s),
    }


def logging_faults(loop: DriverLoop, step: int, fn: Callable[[], Any]) -> dict[str, float]:
    """``fn()``; when an error that carries metrics stops the run (env faults: their
    counters), they are logged first."""
    try:
        result: dict[str, float] = fn()
        return result
    except Exception as err:
        metrics = getattr(err, "metrics", None)
        if isinstance(metrics, dict) and metrics:
            loop.log_extra(step, metrics)
        raise
