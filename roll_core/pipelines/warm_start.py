"""The agentic warm start: SFT on scripted episodes before RL step 1 (`warm_start:`).

Each of ``warm_start.steps`` steps plays ``warm_start.episodes_per_step`` episodes with the
warm start's policy (uniformly random *valid* actions, or each env's expert; an agent
program's calls are answered by its ``expert()``), lays them out as the rollout would
(StarPO or GiGPO rows) and takes one SFT step on them with the run's actor_train, at
``warm_start.lr`` and outside the RL schedule. It is logged at step 0 and not checkpointed:
a resumed run has it already.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roll_core.backends.infer import Completion
from roll_core.config.agentic import AgenticConfig
from roll_core.data import Batch
from roll_core.data.vision import VISION_FIELDS
from roll_core.engine import Cluster
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout, describe_fault
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop
from roll_core.pipelines.rl_loop import logging_faults
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvSpec,
    Trajectory,
    play_episode,
    step_batch,
    trajectory_batch,
)
from roll_core.rollout.agentic.agent_episode import expert_responder, play_scripted
from roll_core.rollout.agentic.endpoint import AgentEndpoint
from roll_core.rollout.producer import RolloutProducer

if TYPE_CHECKING:
    from roll_core.pipelines.agentic import AgenticSetup

DEMO_SEED_START = 2_000_000_000  # warm-start demonstrations: neither training nor eval seeds
WARM_START_WHAT = {"random": "random valid actions", "expert": "the env's expert actions"}


def demonstrations(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    specs: list[EnvSpec],
    *,
    count: int,
    offset: int,
    faults: dict[str, float] | None = None,
) -> list[Trajectory]:
    """`count` episodes per env played by the warm start's policy (``warm_start.policy``:
    uniformly random *valid* actions, or the env's ``expert_action``), in the rollout's prompt
    format; each response is the action text + eos.

    Env calls run under ``rollout.step_timeout_s`` as in training; an episode whose env raises
    or hangs is counted in `faults` (``warm_start/env_errors`` / ``env_timeouts``) and replaced
    by another seed; :class:`EnvFault` once more than ``count`` + (episodes completed) have
    failed, i.e. when more than half of an env's episodes fail.
    """
    chat = ChatFormat(setup.tokenizer, setup.processor)
    # agent programs call an endpoint answered by their expert(): one for these episodes
    endpoint = (
        AgentEndpoint(port=0, model=cfg.model.path, aliases=tuple(cfg.rollout.agent_model_aliases))
        if any(x.agent for x in specs)
        else None
    )
    try:
        return _demonstrations(cfg, setup, specs, chat, endpoint, count, offset, faults)
    finally:
        if endpoint is not None:
            endpoint.close()


def _demonstrations(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    specs: list[EnvSpec],
    chat: ChatFormat,
    endpoint: AgentEndpoint | None,
    count: int,
    offset: int,
    faults: dict[str, float] | None,
) -> list[Trajectory]:
    from roll_core.pipelines.agentic import settings  # agentic.py imports this module

    s = settings(cfg, setup)
    faults = {} if faults is None else faults
    out = []
    for spec in specs:
        if spec.agent is not None:
            assert endpoint is not None
            out += _agent_demos(cfg, setup, spec, chat, endpoint, count, offset, faults)
            continue
        failed: list[str] = []
        slot = 0
        while slot < count:
            # a replaced episode plays another seed, outside every slot's first seed
            seed = DEMO_SEED_START + 1_000_000 * len(failed) + offset + slot
            actor = _ScriptedActor(spec, chat, seed, s.step_timeout_s, cfg.warm_start.policy)
            traj = Trajectory(tag=spec.tag, group=slot, seed=seed, index=0)
            try:
                out.append(
                    play_episode(
                        traj,
                        spec,
                        chat=chat,
                        settings=s,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        generate=actor.generate,
                        env_call=actor.env_call,
                    )
                )
                slot += 1
            except Exception as err:  # noqa: BLE001 - the env raised or hung: count, replace
                _demo_failed(cfg, spec, err, failed, slot, count, faults)
    return out


def _demo_failed(
    cfg: AgenticConfig,
    spec: EnvSpec,
    err: Exception,
    failed: list[str],
    completed: int,
    count: int,
    faults: dict[str, float],
) -> None:
    """Count a failed warm-start episode; EnvFault once more than half of them failed."""
    kind = "env_timeouts" if isinstance(err, EnvTimeout) else "env_errors"
    faults[f"warm_start/{kind}"] = faults.get(f"warm_start/{kind}", 0.0) + 1
    failed.append(describe_fault(err))
    if len(failed) > count + completed:  # more than half of the episodes failed
        raise EnvFault(
            f"warm start: env {spec.tag} failed {len(failed)} "
            f"{cfg.warm_start.policy}-policy episodes while {completed} completed (step timeout "
            f"rollout.step_timeout_s={cfg.rollout.step_timeout_s:g}s). First error: "
            f"{failed[0]}",
            hint="Fix the env (`roll debug-env ENV --policy random` shows the "
            "error), raise rollout.step_timeout_s if its steps are slow, or set "
            "warm_start.steps: 0.",
            metrics=faults,
        ) from None


def _agent_demos(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    spec: EnvSpec,
    chat: ChatFormat,
    endpoint: AgentEndpoint,
    count: int,
    offset: int,
    faults: dict[str, float],
) -> list[Trajectory]:
    """``count`` expert episodes of an agent program, played at once (up to
    ``rollout.max_concurrent_episodes``: an agent's own start-up and tool time overlap); a
    failed one is replayed on another seed in the next round, as env demonstrations are."""
    from concurrent.futures import ThreadPoolExecutor

    done: dict[int, Trajectory] = {}
    failed: list[str] = []
    pending = list(range(count))
    workers = max(1, min(count, cfg.rollout.max_concurrent_episodes))
    with ThreadPoolExecutor(workers, thread_name_prefix="warm-start-agent") as pool:
        for round_ in range(count + 1):
            if not pending:
                break

            def play(slot: int, round_: int = round_) -> Trajectory:
                seed = DEMO_SEED_START + 1_000_000 * round_ + offset + slot
                traj = Trajectory(tag=spec.tag, group=slot, seed=seed, index=0)
                timeout = cfg.rollout.episode_timeout_s
                return _agent_demo(cfg, setup, spec, traj, chat, endpoint, timeout)

            futures = {slot: pool.submit(play, slot) for slot in pending}
            pending = []
            for slot, future in futures.items():
                try:
                    done[slot] = future.result()
                except Exception as err:  # noqa: BLE001 - the agent failed: count, replay
                    pending.append(slot)
                    _demo_failed(cfg, spec, err, failed, len(done), count, faults)
    return [done[k] for k in range(count)]


def _agent_demo(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    spec: EnvSpec,
    traj: Trajectory,
    chat: ChatFormat,
    endpoint: AgentEndpoint,
    timeout: float,
) -> Trajectory:
    """A warm-start episode of an agent program, its calls answered by its expert()."""
    assert spec.agent is not None
    return play_scripted(
        traj,
        spec.agent,
        expert_responder(spec.agent, chat),
        endpoint=endpoint,
        chat=chat,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_context=setup.max_context,
        timeout=timeout,
        history=cfg.rollout.agent_history,
    )


class _ScriptedActor:
    """Plays a uniformly random valid action (policy ``random``) or the env's expert action
    (``expert``; a random valid one where the expert has none) each turn; the response is the
    action's text + eos."""

    def __init__(
        self, spec: EnvSpec, chat: ChatFormat, seed: int, timeout: float, policy: str = "random"
    ) -> None:
        self.spec, self.chat, self.seed, self.timeout = spec, chat, seed, timeout
        self.policy = policy
        self.rng = np.random.default_rng(seed)
        self.env: Any = None

    def env_call(self, fn: Any, *args: Any) -> Any:
        result = call_with_timeout(fn, *args, timeout=self.timeout)
        if fn is self.spec.factory:
            self.env = result
        return result

    def generate(self, prompt: list[int], turn: int, vision: Any = None) -> Completion:
        eos = [self.chat.eos_id] if self.chat.eos_id is not None else []
        action = None
        if self.policy == "expert":
            action = call_with_timeout(self.env.expert_action, timeout=self.timeout)
        if action is None:
            action = call_with_timeout(self.env.random_action, self.rng, timeout=self.timeout)
        ids = self.chat.encode(action) + eos
        return Completion(0, ids, [0.0] * len(ids), "stop", -1)


def warm_start(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    actor: Cluster,
    specs: list[EnvSpec],
    advance: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """SFT on the warm start policy's episodes (random valid actions: the format; the env's
    expert: a demonstration warm start); returns its metrics.
    ``advance`` is called after each step (progress)."""
    w = cfg.warm_start
    losses = []
    faults: dict[str, float] = {"warm_start/env_errors": 0.0, "warm_start/env_timeouts": 0.0}
    per_env = max(1, w.episodes_per_step // len(specs))
    for k in range(w.steps):
        demos = demonstrations(cfg, setup, specs, count=per_env, offset=k * per_env, faults=faults)
        build = step_batch if cfg.rollout.mode == "step" else trajectory_batch
        batch = build(
            [[t] for t in demos], pad_id=setup.tokenizer.pad_token_id, max_len=setup.max_context
        )
        resp = batch.tensors["response_mask"]
        batch = Batch(
            tensors={
                "input_ids": batch.tensors["input_ids"],
                "attention_mask": batch.tensors["attention_mask"],
                "loss_mask": torch.cat([torch.zeros_like(resp[:, :1]), resp], dim=1).long(),
            },
            non_tensors={k: batch.non_tensors[k] for k in VISION_FIELDS if k in batch},
            meta={"loss_tokens": int(resp.sum())},
        )
        out = actor.train_step(batch, lr=w.lr or cfg.actor_train.optim.lr)  # outside the schedule
        losses.append(out["train/loss_sum"] / max(1, int(resp.sum())))
        advance()
    return {
        "warm_start/steps": float(w.steps),
        "warm_start/loss_last": losses[-1],
        "warm_start/lr": out["train/lr"],
        **faults,
    }


def warm_start_phase(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    rl: roles.RLRoles,
    producer: RolloutProducer[Trajectory],
    specs: list[EnvSpec],
    loop: DriverLoop,
    evaluate: bool,
    eval_specs: list[EnvSpec],
) -> None:
    """The warm start before step 1 (validation before it if asked), logged at step 0."""
    from roll_core.pipelines.agentic import validate  # agentic.py imports this module

    if evaluate and cfg.warm_start.eval_before:
        with loop.phase("evaluating"):
            before = validate(cfg, producer, eval_specs)
        loop.log_extra(
            0, {k.replace("eval/", "eval_before_warm_start/"): v for k, v in before.items()}
        )
    t = time.perf_counter()
    what = WARM_START_WHAT[cfg.warm_start.policy]
    with loop.phase(f"warm start (SFT on {what})", cfg.warm_start.steps) as p:
        metrics = logging_faults(
            loop, 0, lambda: warm_start(cfg, setup, rl.actor_train, specs, advance=p.advance)
        )
    metrics["warm_start/seconds"] = time.perf_counter() - t
    loop.console_note(
        f"warm start: {cfg.warm_start.steps} SFT steps on {what}, "
        f"loss {metrics['warm_start/loss_last']:.3f}"
    )
    loop.log_extra(0, metrics)
