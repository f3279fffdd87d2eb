"""Multi-turn agentic rollout: a group is the G episodes of one env seed, each episode on its
own thread, produced by the one rollout producer (:mod:`roll_core.rollout.producer`: admission,
redundancy, staleness, the fault budget, dynamic sampling and the weight sync are there).

Every episode runs its own loop, with no barrier across episodes::

    obs = env.reset(seed)
    while not done:
        ids      = prompt of the conversation so far      (token-in: no re-tokenisation)
        response = generate(ids)                          (a request to the actor_infer cluster)
        obs, reward, done = env.step(decode(response))    (with a per-step timeout)

* Generation requests from all episodes go through the rollout router
  (:mod:`roll_core.rollout.router`). Streaming (the default): each turn is its own request,
  with the episode as its session, so every turn of an episode goes to the rank whose prefix
  cache holds the conversation (unless that rank is far more loaded); the engine batches the
  requests in flight continuously. Deterministic (``rollout.deterministic``): requests queue
  and go out in fixed-batch calls of at most ``chunk_size``, at most ``max_chunks_in_flight``
  per rank. No episode waits for another one's *env* step.
* Redundancy is per group (``redundant_groups``, the producer's): the step takes the groups
  that finish first, every episode of each run to its end. Keeping "the first G episodes of a
  group to finish" instead would favour short episodes (a fall into a hole ends a FrozenLake
  episode at once): a learning bias.
* An env that raises, or hangs past ``step_timeout_s`` (or the episode past
  ``episode_timeout_s``), ends that episode: it is counted (``env_errors`` / ``env_timeouts``)
  (the first ``SHOWN_FAULTS`` of each env, with their error text, are shown on the console)
  and a fresh env instance replays the group's seed in its place (at most
  ``max_replacements`` times per group; a group that cannot be completed fails, and the
  producer drops it and admits another). An episode whose inference rank died is replaced the
  same way (``rank_lost``; the router sends its replay to a live rank); with no rank left the
  run fails, naming the rank.
* Every turn records the policy version of the weights that generated it; a group is as old
  as its oldest turn. A cancelled episode (its group finished or was abandoned) aborts its
  request in flight.

The episode loop is in :mod:`.episode`, the tensors the trainer gets in :mod:`.batch`, the
chat-template bookkeeping in :mod:`.chat`. This package knows nothing about Ray: it only
talks to the router.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.vision import VisionInputs
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout, describe_fault
from roll_core.errors import WorkerDiedError
from roll_core.rollout.agentic.agent_episode import play_agent_episode
from roll_core.rollout.agentic.chat import ChatFormat
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession
from roll_core.rollout.agentic.episode import (
    EnvSpec,
    EpisodeCancelled,
    RolloutSettings,
    Trajectory,
    play_episode,
)
from roll_core.rollout.producer import Group, Members, RolloutProducer
from roll_core.rollout.router import Router, RouterClosed


class _TurnBarrier:
    """The synchronous baseline (``turn_barrier``): an episode starts turn k only when every
    running training episode has finished turn k-1, as in a batch rollout that steps all envs
    and then generates for all of them. Only for comparisons (benchmarks/agentic_async.py)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turns: dict[int, int] = {}

    def join(self, key: int) -> None:
        with self.cond:
            self.turns[key] = 0

    def leave(self, key: int) -> None:
        with self.cond:
            self.turns.pop(key, None)
            self.cond.notify_all()

    def wait(self, key: int, turn: int, cancel: threading.Event) -> None:
        with self.cond:
            self.turns[key] = turn
            self.cond.notify_all()
            while min(self.turns.values()) < turn and not cancel.is_set():
                self.cond.wait(0.2)


# ---- groups and episodes ------------------------------------------------------------------------
@dataclass
class _Episode:
    traj: Trajectory
    cancel: threading.Event
    params: SamplingParams
    request_id: int | None = None  # its generation request in flight, if any


@dataclass(frozen=True)
class GroupOptions:
    """How one group's episodes run: its env, its sampling, its spare episodes."""

    spec: EnvSpec
    params: SamplingParams
    spare: int
    """Episodes that may replace failed ones (``rollout.max_replacements``; validation: 0)."""


@dataclass
class _Running:
    """The episodes of one group: running, launched, replacements left."""

    running: list[_Episode] = field(default_factory=list)
    launched: int = 0
    spare: int = 0


class EpisodeMembers(Members[Trajectory]):
    """The G episodes of an env seed, each on its own thread (see the module docstring)."""

    unit = "groups"

    def __init__(
        self,
        *,
        infer: Any,
        tokenizer: Any,
        specs: list[EnvSpec],
        settings: RolloutSettings,
        processor: Any | None = None,
    ) -> None:
        self.infer = infer
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, processor)  # processor: VLMs (image observations)
        self.specs = {spec.tag: spec for spec in specs}
        self.s = settings
        self.router = Router(
            infer,
            deterministic=settings.deterministic,
            chunk_size=settings.chunk_size,
            max_chunks_in_flight=settings.max_chunks_in_flight,
            request_timeout_s=settings.request_timeout_s,
        )
        self._request_id = 0
        self.pool = ThreadPoolExecutor(
            max_workers=settings.max_concurrent_episodes, thread_name_prefix="episode"
        )
        self.next_group_seed = {spec.tag: 0 for spec in specs}
        self.counters: dict[str, float] = {}
        self.first_fault: dict[str, str] = {}  # tag -> the first env fault of the run
        self.fault_notes: list[str] = []  # the first faults of each env, to be shown
        self._faults_noted: dict[str, int] = {}
        self.running: dict[int, _Episode] = {}
        self._groups: dict[int, _Running] = {}
        self.barrier = _TurnBarrier() if settings.turn_barrier else None
        self.endpoint = (  # agent programs call the policy through it (bring your own agent)
            AgentEndpoint(
                port=settings.endpoint_port,
                model=settings.served_model,
                aliases=settings.agent_model_aliases,
            )
            if any(spec.agent is not None for spec in specs)
            else None
        )

    # ---- the producer's calls ----------------------------------------------------------------
    def next_key(self, tag: str) -> int:
        """The env seed of the tag's next training group."""
        k = self.next_group_seed[tag]
        self.next_group_seed[tag] += 1
        return self.s.seed * 1_000_003 + k

    def launch(self, groups: list[Group[Trajectory]]) -> None:
        for group in groups:
            if group.options is None:
                group.options = GroupOptions(
                    self.specs[group.tag], self.s.params, self.s.max_replacements
                )
            self._groups[group.gid] = _Running(spare=group.options.spare)
            for _ in range(group.size):
                self._launch_episode(group)

    def cancel(self, group: Group[Trajectory]) -> None:
        for ep in self._groups[group.gid].running:
            self._cancel(ep)

    def version(self, group: Group[Trajectory]) -> int:
        """The oldest weights that produced any of the group's turns."""
        return min(t.min_version for t in group.kept)

    def rewards(self, group: Group[Trajectory]) -> list[float]:
        return [t.episode_return for t in group.kept]

    def ordered(self, group: Group[Trajectory]) -> list[Trajectory]:
        return sorted(group.kept, key=lambda t: t.index)

    def state_dict(self, pending: list[Group[Trajectory]]) -> dict[str, Any]:
        return {"next_group_seed": dict(self.next_group_seed), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_seed.update(state["next_group_seed"])
        self.counters = dict(state.get("counters", {}))

    def close(self) -> None:
        with self.producer.cond:
            episodes = list(self.running.values())
            for ep in episodes:
                ep.cancel.set()
        self.router.close()  # waiting episodes: RouterClosed -> cancelled
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.endpoint is not None:
            self.endpoint.close()

    def _launch_episode(self, group: Group[Trajectory]) -> None:
        """(lock held) Start one more episode of `group` on the pool."""
        state = self._groups[group.gid]
        traj = Trajectory(tag=group.tag, group=group.gid, seed=group.key, index=state.launched)
        state.launched += 1
        ep = _Episode(traj, threading.Event(), group.options.params)
        state.running.append(ep)
        self.running[id(ep)] = ep
        if self.barrier is not None and group.counted:
            self.barrier.join(id(ep))
        self.pool.submit(self._episode_main, group, ep)

    # ---- one episode ---------------------------------------------------------------------------
    def _episode_main(self, group: Group[Trajectory], ep: _Episode) -> None:
        start = time.perf_counter()
        try:
            if ep.cancel.is_set():  # its group finished while it waited for a thread
                raise EpisodeCancelled()
            self._play(group, ep, start)
        except EpisodeCancelled:
            ep.traj.status = "cancelled"
        except EnvTimeout as err:
            ep.traj.status, ep.traj.error = "timeout", describe_fault(err)
        except _RankLost as err:  # replaced like a failed env episode (the fault budget)
            ep.traj.status, ep.traj.error = "rank_lost", str(err.cause)
        except _GenerationFailed as err:
            ep.traj.status, ep.traj.error = "gen_error", str(err.cause)
            self.producer.fail(err.cause)
        except Exception as err:  # noqa: BLE001 - an env that raises ends its episode
            ep.traj.status, ep.traj.error = "error", describe_fault(err)
        ep.traj.wall_s = time.perf_counter() - start
        self._episode_ended(group, ep)

    def _play(self, group: Group[Trajectory], ep: _Episode, start: float) -> None:
        s = self.s
        deadline = start + s.episode_timeout_s

        def remaining() -> float:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise EnvTimeout(f"episode ran past episode_timeout_s={s.episode_timeout_s}")
            return left

        def env_call(fn: Callable[..., Any], *args: Any) -> Any:
            return call_with_timeout(fn, *args, timeout=min(s.step_timeout_s, remaining()))

        def generate(
            prompt: list[int],
            turn: int,
            vision: VisionInputs | None,
            params: SamplingParams | None = None,
        ) -> Completion:
            """One request (``params``: an agent call's own; None: the episode's)."""
            if ep.cancel.is_set():
                raise EpisodeCancelled()
            if self.barrier is not None and group.counted:
                self.barrier.wait(id(ep), turn, ep.cancel)
            seed = hash((group.key, ep.traj.index, turn, s.seed)) % 2**31
            with self.producer.cond:
                self._request_id += 1
                ep.request_id = self._request_id
            request = Request(ep.request_id, prompt, seed, vision=vision)
            future = self.router.submit(request, params or ep.params, session=id(ep))
            try:
                completion = self._wait(future, ep, remaining)
            except BaseException:
                self.router.abort([request.request_id])  # e.g. the episode timed out
                raise
            finally:
                ep.request_id = None
            if ep.cancel.is_set() or completion.finish_reason == "abort":
                raise EpisodeCancelled()
            return completion

        try:
            spec = group.options.spec
            if spec.agent is not None and self.endpoint is not None:
                session = AgentSession(
                    ep.traj,
                    self.chat,
                    generate,
                    max_new_tokens=ep.params.max_new_tokens,
                    max_context=s.max_context,
                    model=s.served_model,
                    history=s.agent_history,
                    sampling=ep.params,
                    agent_sampling=s.agent_sampling,
                )
                try:
                    play_agent_episode(
                        ep.traj,
                        spec.agent,
                        endpoint=self.endpoint,
                        session=session,
                        cancel=ep.cancel,
                        remaining=remaining,
                    )
                finally:
                    if session.undelivered and group.counted:
                        key = f"rollout/{ep.traj.tag}/agent_replies_undelivered"
                        with self.producer.cond:
                            self._count_key(key, float(session.undelivered))
            else:
                self._play_turns(group, ep, generate, env_call)
        finally:
            self.router.release(id(ep))

    def _play_turns(
        self, group: Group[Trajectory], ep: _Episode, generate: Any, env_call: Any
    ) -> None:
        play_episode(
            ep.traj,
            group.options.spec,
            chat=self.chat,
            settings=self.s,
            max_new_tokens=ep.params.max_new_tokens,
            generate=generate,
            env_call=env_call,
        )

    def _cancel(self, ep: _Episode) -> None:
        """(lock held) End episode ``ep``: its request in flight is aborted at once."""
        ep.cancel.set()
        if ep.request_id is not None:
            self.router.abort([ep.request_id])

    def _wait(self, future: Future, ep: _Episode, remaining: Callable[[], float]) -> Completion:
        while True:
            if ep.cancel.is_set() and ep.request_id is not None:
                self.router.abort([ep.request_id])  # resolves the future with a partial
            wait_s = min(0.5, remaining())  # EnvTimeout past the episode's deadline
            try:
                result: Completion = future.result(timeout=wait_s)
                return result
            except TimeoutError:
                continue
            except (EpisodeCancelled, RouterClosed):
                raise EpisodeCancelled() from None
            except WorkerDiedError as err:
                if not self.router.live_ranks():  # no rank left to replay the episode on
                    raise _GenerationFailed(err) from err
                raise _RankLost(err) from err
            except BaseException as err:  # noqa: BLE001 - generation failure: fatal for the run
                raise _GenerationFailed(err) from err

    def _episode_ended(self, group: Group[Trajectory], ep: _Episode) -> None:
        traj = ep.traj
        with self.producer.cond:
            state = self._groups[group.gid]
            state.running.remove(ep)
            self.running.pop(id(ep), None)
            if self.barrier is not None:
                self.barrier.leave(id(ep))
            group.ended.append(traj)
            if group.counted:
                self._count(traj)
                if traj.status in _REPLACEABLE:
                    self.first_fault.setdefault(traj.tag, traj.error)
            if traj.status in _REPLACEABLE:
                self._note_fault(traj, "training" if group.counted else "validation")
            if group.finished:
                pass
            elif traj.ok:
                group.kept.append(traj)
                if len(group.kept) == group.size:
                    for other in state.running:
                        self._cancel(other)
                    self.producer.group_ended(group)
            elif traj.status in _REPLACEABLE and state.spare > 0:
                state.spare -= 1
                self._count_key(f"rollout/{traj.tag}/env_replaced")
                self._launch_episode(group)
            if not group.finished and not state.running:
                group.failed = True  # cannot reach its size any more
                self.producer.group_ended(group)
            if group.finished and not state.running:
                del self._groups[group.gid]

    def step_metrics(self, groups: list[Group[Trajectory]]) -> dict[str, float]:
        return self._counters_metrics()

    def fault_stop(self, tag: str, failed_groups: int) -> EnvFault:
        """The error that stops the run when env `tag` fails more groups than a step allows;
        it carries the rollout counters of the step so far (to be logged before stopping)."""
        metrics = self._counters_metrics()
        metrics[f"rollout/{tag}/groups_dropped_failed"] = float(failed_groups)
        errors = int(metrics.get(f"rollout/{tag}/env_errors", 0))
        timeouts = int(metrics.get(f"rollout/{tag}/env_timeouts", 0))
        done = int(metrics.get(f"rollout/{tag}/episodes_completed", 0))
        return EnvFault(
            f"env {tag} failed too often: in this step {errors + timeouts} of its episodes "
            f"failed ({errors} raised, {timeouts} timed out) and {done} completed, so {failed_groups} groups could "
            f"not be completed with rollout.max_replacements={self.s.max_replacements} "
            f"replacements each. First error: {self.first_fault.get(tag, '?')}",
            hint="Fix the env (`roll debug-env` plays it and shows the error), or raise "
            "rollout.max_replacements (more failed episodes per group) or, if its steps are "
            "slow rather than hung, rollout.step_timeout_s / rollout.episode_timeout_s. The fault counts are in "
            "metrics.jsonl (rollout/env_errors, rollout/env_timeouts).",
            metrics=metrics,
        )

    def _note_fault(self, traj: Trajectory, phase: str) -> None:
        """(lock held) Keep the text of each env's first SHOWN_FAULTS faults of the run."""
        n = self._faults_noted.get(traj.tag, 0) + 1
        if n > SHOWN_FAULTS:
            return
        self._faults_noted[traj.tag] = n
        text = f"{phase} episode of {traj.tag} failed ({traj.status}): {traj.error}"
        if n == SHOWN_FAULTS:
            text += (
                f" [the first {SHOWN_FAULTS} faults of {traj.tag} are shown; the rest are only "
                "counted: rollout/ and eval/ env_errors, env_timeouts]"
            )
        self.fault_notes.append(text)

    def take_fault_notes(self) -> list[str]:
        """The fault texts kept since the last call (see SHOWN_FAULTS), for the console."""
        with self.producer.cond:
            notes, self.fault_notes = self.fault_notes, []
        return notes

    # ---- counters ----------------------------------------------------------------------------------
    def _count_key(self, key: str, value: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + value

    def _count(self, traj: Trajectory) -> None:
        tag = traj.tag
        if traj.status == "error":
            self._count_key(f"rollout/{tag}/env_errors")
        elif traj.status == "timeout":
            self._count_key(f"rollout/{tag}/env_timeouts")
        elif traj.status == "rank_lost":
            self._count_key(f"rollout/{tag}/rank_lost")
        elif traj.status == "cancelled":
            self._count_key(f"rollout/{tag}/episodes_cancelled")
        elif traj.ok:
            self._count_key(f"rollout/{tag}/episodes_completed")

    def _counters_metrics(self) -> dict[str, float]:
        """Counters since the last call (then reset)."""
        with self.producer.cond:
            out, self.counters = dict(self.counters), {}
        errors = sum(v for k, v in out.items() if k.endswith("/env_errors"))
        timeouts = sum(v for k, v in out.items() if k.endswith("/env_timeouts"))
        out["rollout/env_errors"] = errors
        out["rollout/env_timeouts"] = timeouts
        return out


SHOWN_FAULTS = 3
"""Faulted episodes per env whose error text the run's console shows (the rest are counted)."""

_REPLACEABLE = ("error", "timeout", "rank_lost")
"""Episode endings replaced by a fresh episode on the same seed (``max_replacements``)."""


class _RankLost(Exception):
    """The inference rank serving the episode died (other ranks live): replace the episode."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _GenerationFailed(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def env_producer(
    *,
    infer: Any,
    tokenizer: Any,
    specs: list[EnvSpec],
    settings: RolloutSettings,
    processor: Any | None = None,
    dynamic_sampling: bool = False,
    max_additional_groups: int = 0,
) -> RolloutProducer[Trajectory]:
    """The rollout producer of env groups: ``groups_per_step`` groups of
    ``settings.group_size`` episodes per env spec (tags: the specs' names)."""
    members = EpisodeMembers(
        infer=infer, tokenizer=tokenizer, specs=specs, settings=settings, processor=processor
    )
    return RolloutProducer(
        members,
        per_step={spec.tag: spec.groups_per_step for spec in specs},
        size=settings.group_size,
        async_generation_ratio=settings.async_generation_ratio,
        redundant=settings.redundant_groups,
        dynamic_sampling=dynamic_sampling,
        max_additional=max_additional_groups,
    )


def run_episodes(
    producer: RolloutProducer[Trajectory],
    spec: EnvSpec,
    seeds: list[int],
    params: SamplingParams,
) -> list[Trajectory]:
    """One episode per seed (validation), beside the training groups: no redundancy, no
    replacement, a failed episode is returned as such."""
    options = GroupOptions(spec, params, spare=0)
    groups = producer.run_groups(spec.tag, seeds, 1, options)
    return [g.kept[0] if g.kept else g.ended[-1] for g in groups]
