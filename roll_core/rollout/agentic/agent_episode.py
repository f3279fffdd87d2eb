"""One episode of a user's agent program (bring your own agent): the agent's ``run(client,
task)`` on its own thread, its model calls served by the episode's session on the endpoint
(:mod:`.endpoint`), which stitches them into the trajectory.

How an episode ends:

* ``run`` returns a number: that is the episode's return (on its last turn); ``success`` is
  ``reward > 0``; status ``done``. Or ``{"reward": r, "success": bool}``: partial credit that
  is not counted a success (with ``"metrics": {name: number}``: the episode's own numbers,
  averaged into ``rollout/env/<name>``; the endpoint adds ``first_call_s``, the agent's
  start-up).
* the conversation outgrew ``rollout.max_context``: status ``context`` (kept, like an env
  episode cut by the context), with the reward ``run`` returned, or 0 if it raised; the
  refused call is not in the trajectory (:mod:`.endpoint`). A first call that does not fit
  is a fault (nothing was generated).
* faults, counted and replaced like env faults (``env_errors`` / ``env_timeouts``) and carrying
  the agent's own error text: ``run`` raised; it ran past ``rollout.episode_timeout_s``; it
  returned without calling the model, or returned something that is not a number.
* the episode was cancelled (its group finished) or its inference rank died: the error the
  session's generation raised.

A ``run`` that does not return in time cannot be killed (it is a thread): its session is closed,
so its next call to the endpoint fails, and the thread is abandoned.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
import time
from collections.abc import Callable
from typing import Any

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.envs.agents import AgentProgram, expert_text
from roll_core.envs.faults import EnvTimeout, describe_fault
from roll_core.errors import ConfigError
from roll_core.rollout.agentic.chat import ChatFormat
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession
from roll_core.rollout.agentic.episode import EpisodeCancelled, Trajectory, env_numbers


class AgentFault(Exception):
    """The agent program raised, or broke the contract (no model call, a reward that is not a
    number). ``fault_text`` is the episode's error: the agent's own, where in its code."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.fault_text = text


def agent_error(err: BaseException, program: AgentProgram) -> AgentFault:
    """``err`` raised by ``run``, located at the innermost frame in the agent's own file (an
    openai error is raised deep inside the client; the agent's line is the useful one)."""
    return AgentFault(describe_fault(err, program.source_file(program.run)))


def openai_client(base_url: str, *, is_async: bool, timeout: float) -> Any:
    """The client handed to ``run``: no retries (an error is the episode's), the session URL."""
    try:
        import openai
    except ImportError:
        raise ConfigError(
            "an agent env needs the `openai` package (the client roll hands to run()).",
            hint="pip install openai (or roll's `agents` extra).",
        ) from None
    cls = openai.AsyncOpenAI if is_async else openai.OpenAI
    return cls(base_url=base_url, api_key="roll", max_retries=0, timeout=timeout)


def run_agent(program: AgentProgram, base_url: str, task: Any, timeout: float) -> Any:
    """``program.run(client, task)`` to its end (in this thread), with a fresh client."""
    if program.is_async:

        async def main() -> Any:
            async with openai_client(base_url, is_async=True, timeout=timeout) as client:
                return await program.run(client, task)

        return asyncio.run(main())
    with openai_client(base_url, is_async=False, timeout=timeout) as client:
        return program.run(client, task)


def play_agent_episode(
    traj: Trajectory,
    program: AgentProgram,
    *,
    endpoint: AgentEndpoint,
    session: AgentSession,
    cancel: threading.Event,
    remaining: Callable[[], float],
    task: Any = None,
) -> Trajectory:
    """Play one agent episode into ``traj`` (see the module docstring). ``remaining()`` raises
    EnvTimeout past the episode's deadline; ``task``: None makes it from the seed."""
    task = program.task(traj.seed) if task is None else task
    base_url = endpoint.open(session)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run_agent(program, base_url, task, timeout=remaining())
        except BaseException as err:  # noqa: BLE001 - re-raised on the episode's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=f"agent-{traj.tag}", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            if cancel.is_set():
                raise EpisodeCancelled()
            if session.failure is not None and not session.context_full:
                raise session.failure  # the agent may swallow the endpoint's error: end now
            thread.join(min(0.1, remaining()))
    finally:
        endpoint.close_session(session)
    return _finish(traj, program, session, box)


def _finish(
    traj: Trajectory, program: AgentProgram, session: AgentSession, box: dict[str, Any]
) -> Trajectory:
    if session.failure is not None and not session.context_full:
        raise session.failure  # cancelled, timed out or rank lost while generating
    if "error" in box and not session.context_full:
        raise agent_error(box["error"], program) from box["error"]
    value = box.get("value", 0.0) if "error" not in box else 0.0
    if not traj.turns and session.context_full:
        raise AgentFault(
            f"agent {program.path}: its first call was refused ({session.context_error}), so "
            "the model generated nothing to train; shorten the agent's first prompt or raise "
            "rollout.max_context"
        )
    if not traj.turns:
        raise AgentFault(
            f"agent {program.path}: run() returned {value!r} without calling the model (no "
            "chat.completions call on the client it was given), so there is nothing to train"
        )
    reward, success = _outcome(value, program)
    if isinstance(value, dict) and isinstance(value.get("metrics"), dict):
        traj.env_metrics = env_numbers({"episode_metrics": value["metrics"]})
    if session.first_call:  # the agent's start-up: from the episode's start to its first call
        traj.env_metrics["first_call_s"] = session.first_call - session.opened
    traj.turns[-1].reward = reward
    traj.episode_return = reward
    traj.success = success
    traj.status = "context" if session.context_full else "done"
    return traj


Respond = Callable[[Any, list[Any], list[int], int], list[int]]
"""``respond(task, request_messages, prompt_ids, turn) -> response ids`` (eos included)."""


def play_scripted(
    traj: Trajectory,
    program: AgentProgram,
    respond: Respond,
    *,
    endpoint: AgentEndpoint,
    chat: ChatFormat,
    max_new_tokens: int,
    max_context: int,
    timeout: float,
    history: str = "segment",
) -> Trajectory:
    """One episode of the agent outside the rollout router: each call is answered by
    ``respond`` (the warm start's expert, ``roll debug-env``'s model), with log-prob 0."""
    task = program.task(traj.seed)
    session: AgentSession

    def generate(prompt: list[int], turn: int, vision: Any, params: SamplingParams) -> Completion:
        # the call's own stop strings and max_tokens apply; the recipe's cap (a model's budget)
        # does not bind an expert
        cap = params.max_new_tokens if params.max_new_tokens < max_new_tokens else None
        ids, finish = scripted_limits(
            chat, respond(task, session.request, prompt, turn), prompt, params, cap
        )
        return Completion(turn, ids, [0.0] * len(ids), finish, -1)

    session = AgentSession(
        traj, chat, generate, max_new_tokens, max_context, endpoint.model, history=history
    )
    deadline = time.perf_counter() + timeout

    def remaining() -> float:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise EnvTimeout(f"the episode ran past {timeout:g}s")
        return left

    return play_agent_episode(
        traj,
        program,
        endpoint=endpoint,
        session=session,
        cancel=threading.Event(),
        remaining=remaining,
        task=task,
    )


def scripted_limits(
    chat: ChatFormat,
    ids: list[int],
    prompt: list[int],
    params: SamplingParams,
    cap: int | None = -1,
) -> tuple[list[int], str]:
    """A scripted reply cut as an engine would cut it: at the first stop string (its ids
    kept, as engines keep them), else at ``cap`` tokens (-1: ``params.max_new_tokens``; None:
    no cap); and its finish reason."""
    limit = params.max_new_tokens if cap == -1 else cap
    for n in range(1, len(ids) + 1):
        if limit is not None and n > limit:
            return ids[: n - 1], "length"
        if params.stop:
            tail = str(chat.tokenizer.decode(ids[:n]))
            if any(s in tail for s in params.stop):
                return ids[:n], "stop"
    return ids, "stop" if ids and ids[-1] == chat.eos_id else "length"


def expert_responder(program: AgentProgram, chat: ChatFormat) -> Respond:
    """``respond`` from the module's ``expert(task, messages)``: its reply text + eos (the warm
    start's demonstrations, in exactly the token layout training uses)."""
    expert = program.expert
    if expert is None:
        raise ConfigError(
            f"agent {program.path} has no expert(task, messages) function, so there is no "
            "expert to play it.",
            hint="Define expert(task, messages) in the agent module (docs/agentic.md), or set "
            "warm_start.steps: 0.",
        )
    eos = [chat.eos_id] if chat.eos_id is not None else []

    def respond(task: Any, messages: list[Any], prompt: list[int], turn: int) -> list[int]:
        return chat.encode(expert_text(expert(task, messages))) + eos

    return respond


def _outcome(value: Any, program: AgentProgram) -> tuple[float, bool]:
    """``(reward, success)`` of what ``run`` returned: a number (success: reward > 0), or
    ``{"reward": number, "success": bool}`` (partial credit that is not a success)."""
    success = None
    if isinstance(value, dict) and "reward" in value:
        value, success = value["reward"], value.get("success")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AgentFault(
            f"agent {program.path}: run() returned {value!r} ({type(value).__name__}); it "
            'must return the episode\'s reward as a number (or {"reward": ..., "success": ...})'
        )
    reward = float(value)
    return reward, bool(reward > 0 if success is None else success)
