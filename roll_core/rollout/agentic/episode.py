"""One episode of agentic rollout: what it records (:class:`Trajectory`, :class:`Turn`), how it
is set up (:class:`EnvSpec`, :class:`RolloutSettings`) and its loop (:func:`play_episode`).
See :mod:`roll_core.rollout.agentic.manager` for how episodes are scheduled."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.data.vision import VisionInputs
from roll_core.envs.agents import AgentProgram
from roll_core.envs.base import TextEnv, observation_images
from roll_core.rollout.agentic.chat import ChatFormat, TokenTrace, first_messages


class EpisodeCancelled(Exception):
    """The episode's group completed (or the manager closed) while it was running."""


@dataclass(frozen=True)
class EnvSpec:
    """One kind of env in a run: how to build it and how its episodes are prompted."""

    tag: str
    factory: Callable[[], TextEnv]
    system_prompt: str | None = None  # None: the env's own
    groups_per_step: int = 1
    agent: AgentProgram | None = None  # an agent program instead of an env (agent_episode.py)


@dataclass
class Turn:
    """One observe -> generate -> step turn."""

    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    policy_version: int
    action: str
    reward: float
    state_key: str
    action_is_valid: bool
    gen_s: float
    env_s: float
    vision: VisionInputs | None = None  # the images of prompt_ids (vision-language models)
    segment: int = 0  # agent episodes: the training segment of the trace this turn is in
    routed_experts: Any = None  # router replay: routes of prompt_ids + response_ids


@dataclass
class Trajectory:
    """One episode: its turns, its token trace and how it ended."""

    tag: str
    group: int
    seed: int
    index: int  # launch order within the group
    turns: list[Turn] = field(default_factory=list)
    trace: TokenTrace = field(default_factory=TokenTrace)  # the current (last) segment
    segments: list[TokenTrace] = field(default_factory=list)  # earlier segments (agent calls)
    status: str = "running"  # done | truncated | context | error | timeout | cancelled
    success: bool = False
    episode_return: float = 0.0
    error: str = ""
    wall_s: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The env's own numbers for the episode (its last ``info["episode_metrics"]``: e.g. the
    swe env's steps, diff size, tool errors), averaged into ``rollout/env/<name>``."""

    @property
    def ok(self) -> bool:
        """Ended on its own (terminated, truncated, or out of context): usable for training."""
        return self.status in ("done", "truncated", "context")

    def traces(self) -> list[TokenTrace]:
        """Every training segment's trace, in order: one for an env episode; an agent episode
        whose calls did not continue one conversation has one per conversation
        (``rollout.agent_history: segment``, :mod:`.endpoint`)."""
        return [*self.segments, self.trace]

    def new_segment(self) -> None:
        """Close the current trace and start an empty one (a call that starts over)."""
        self.segments.append(self.trace)
        self.trace = TokenTrace()

    @property
    def min_version(self) -> int:
        return min((t.policy_version for t in self.turns), default=-1)

    @property
    def max_version(self) -> int:
        return max((t.policy_version for t in self.turns), default=-1)


@dataclass
class RolloutSettings:
    """How episodes are run (a plain mirror of the recipe's rollout section)."""

    params: SamplingParams
    group_size: int = 4
    redundant_groups: int = 0  # extra whole groups per env and step (manager.py)
    mode: str = "trajectory"  # trajectory | step
    history_window: int = 2  # step mode: previous (observation, action) turns in the prompt
    max_context: int = 512
    step_timeout_s: float = 30.0
    episode_timeout_s: float = 600.0
    max_replacements: int = 4
    max_concurrent_episodes: int = 64
    deterministic: bool = False  # fixed-batch calls of <= chunk_size (rollout/router.py)
    chunk_size: int = 8
    max_chunks_in_flight: int = 1
    request_timeout_s: float = 600.0
    async_generation_ratio: int = 0
    turn_barrier: bool = False  # the lockstep baseline (benchmarks): see _TurnBarrier
    seed: int = 0
    endpoint_port: int = 0  # agent envs: the OpenAI-compatible endpoint's port (0: any free)
    served_model: str = "policy"  # agent envs: the model name GET /v1/models lists
    agent_history: str = "segment"  # agent envs: segment | strict (endpoint/session.py)
    agent_sampling: str = "strict"  # agent envs: a call's own sampling fields: strict | recipe
    agent_model_aliases: tuple[str, ...] = ()  # agent envs: more names for the served model


def window_prompt(
    chat: ChatFormat,
    system: str,
    history: list[tuple[str, str]],
    observation: str,
    window: int,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], VisionInputs | None]:
    """Step mode: system, the last `window` (observation, action) turns, the observation; the
    ids and the vision inputs of the observations' images (None: no image)."""
    messages: list[dict[str, Any]] = first_messages(system, "")[:-1]
    images: list[Any] = []
    for obs, act in history[-window:] if window else []:
        messages += [*chat.observation_messages(obs), {"role": "assistant", "content": act}]
        images += observation_images(obs)
    messages += chat.observation_messages(observation)
    images += observation_images(observation)
    return chat.prompt_with_images(messages, images, tools)


def play_episode(
    traj: Trajectory,
    spec: EnvSpec,
    *,
    chat: ChatFormat,
    settings: RolloutSettings,
    max_new_tokens: int,
    generate: Callable[[list[int], int, VisionInputs | None], Completion],
    env_call: Callable[..., Any],
) -> Trajectory:
    """Play one episode into `traj`: observe -> generate -> step until the env ends it.

    `generate(prompt_ids, turn, vision)` returns the completion (`vision`: the prompt's
    images, for a vision-language model; None without images); `env_call(fn, *args)` calls the env
    (the manager puts timeouts there). Exceptions (env errors, timeouts, cancellation)
    propagate; a prompt that no longer fits `settings.max_context` ends the episode (status
    `context`).
    """
    s = settings
    env = env_call(spec.factory)
    observation, _ = env_call(env.reset, traj.seed)
    system = spec.system_prompt if spec.system_prompt is not None else env.system_prompt
    history: list[tuple[str, str]] = []  # step mode: (observation, action) turns
    tools = env.tools or None  # native tool calling: the template renders the schemas
    traj.trace.add_context(*chat.first_prompt(system, observation, tools))
    while True:
        if s.mode == "step":
            prompt, vision = window_prompt(
                chat, system, history, observation, s.history_window, tools
            )
        else:
            prompt, vision = list(traj.trace.ids), traj.trace.vision()
        if len(prompt) + max_new_tokens > s.max_context:
            traj.status = "context"
            return traj
        t0 = time.perf_counter()
        completion = generate(prompt, len(traj.turns), vision)
        gen_s = time.perf_counter() - t0
        action = str(chat.tokenizer.decode(completion.response_ids, skip_special_tokens=True))
        key = str(env_call(env.state_key))
        t1 = time.perf_counter()
        result = env_call(env.step, action)
        env_s = time.perf_counter() - t1
        _record_turn(
            traj, completion, result, prompt=prompt, vision=vision, action=action, key=key,
            gen_s=gen_s, env_s=env_s, step_mode=s.mode == "step",
        )  # fmt: skip
        if result.terminated or result.truncated:
            traj.status = "done" if result.terminated else "truncated"
            return traj
        history.append((observation, action))
        observation = result.observation
        ended_with_eos = bool(completion.response_ids) and (
            completion.response_ids[-1] == chat.eos_id
        )
        if s.mode == "step" and not chat.can_append:
            continue  # the trace (metrics only in step mode) cannot be continued: see ChatFormat
        reply, reply_vision = chat.observe(observation, after_eos=ended_with_eos)
        if s.mode != "step" and len(traj.trace.ids) + len(reply) + max_new_tokens > s.max_context:
            traj.status = "context"  # the next turn would not fit: end on the last response
            return traj
        traj.trace.add_context(reply, reply_vision)


def _record_turn(
    traj: Trajectory,
    completion: Completion,
    result: Any,
    *,
    prompt: list[int],
    vision: VisionInputs | None,
    action: str,
    key: str,
    gen_s: float,
    env_s: float,
    step_mode: bool,
) -> None:
    """Add the turn just played to ``traj``: its generated tokens to the trace (with the
    routed experts, outside step mode), the :class:`Turn`, the return, success and the env's
    episode metrics."""
    if not step_mode:  # step mode's prompt is a window, not the trace
        traj.trace.add_routes(completion.routed_experts, prompt)
    traj.trace.add_generated(completion.response_ids, completion.log_probs)
    traj.turns.append(
        Turn(
            prompt_ids=prompt,
            response_ids=list(completion.response_ids),
            log_probs=list(completion.log_probs),
            finish_reason=completion.finish_reason,
            policy_version=completion.policy_version,
            action=action,
            reward=float(result.reward),
            state_key=key,
            action_is_valid=bool(result.info.get("action_is_valid", True)),
            gen_s=gen_s,
            env_s=env_s,
            vision=vision,
            routed_experts=completion.routed_experts,
        )
    )
    traj.episode_return += float(result.reward)
    traj.success = bool(result.info.get("success", False))
    traj.env_metrics = env_numbers(result.info) or traj.env_metrics


def env_numbers(info: Any) -> dict[str, float]:
    """The numbers (and booleans, as 0 / 1) of an env's ``info["episode_metrics"]``;
    anything else is left out."""
    raw = info.get("episode_metrics") if isinstance(info, dict) else None
    if not isinstance(raw, dict):
        return {}
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))}
