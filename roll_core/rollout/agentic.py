"""Environment-level asynchronous rollout for multi-turn agentic RL.

Every episode runs its own loop on its own thread, with no barrier across episodes::

    obs = env.reset(seed)
    while not done:
        ids      = prompt of the conversation so far      (token-in: no re-tokenisation)
        response = generate(ids)                          (a request to the actor_infer cluster)
        obs, reward, done = env.step(decode(response))    (with a per-step timeout)

* Generation requests from all episodes go through one router (`_Router`): pending requests
  are sent in chunks of at most ``chunk_size`` to the least-loaded inference rank, at most
  ``max_chunks_in_flight`` chunks per rank, through the cluster's ``submit`` futures (the
  routing of the RLVR scheduler). A rank that is busy lets requests queue up, so batches form
  by themselves; no episode waits for another one's *env* step.
* A *group* is G episodes of one env with the same seed (the group of the group-relative
  advantages). ``group_size_redundancy`` launches R extra episodes; the first G to finish are
  kept and the rest are cancelled.
* An env that raises, or hangs past ``step_timeout_s`` (or the episode past
  ``episode_timeout_s``), ends that episode: it is counted (``env_errors`` / ``env_timeouts``)
  and a fresh env instance replays the group's seed in its place (at most
  ``max_replacements`` times per group; a group that cannot be completed is dropped and
  another group takes its place).
* Every turn records the policy version of the weights that generated it.
* Async across training steps (``async_generation_ratio`` k > 0): groups keep running while
  the trainer trains; a group is handed to the trainer only if its oldest turn is at most k
  versions old (else it is dropped and counted). Weight sync is ``suspend()`` (the router stops
  sending and waits for chunks in flight) -> update -> ``resume()``; requests queued meanwhile
  go out with the new weights. ``k = 0`` is the synchronous pipeline: nothing runs while
  training.

This module knows nothing about Ray: it only calls ``infer.submit(rank, "generate", ...)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.envs.base import TextEnv
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout, describe_fault
from roll_core.errors import RollError
from roll_core.rollout.agentic_chat import ChatFormat, TokenTrace, first_messages


class EpisodeCancelled(Exception):
    """The episode's group completed (or the manager closed) while it was running."""


@dataclass(frozen=True)
class EnvSpec:
    """One kind of env in a run: how to build it and how its episodes are prompted."""

    tag: str
    factory: Callable[[], TextEnv]
    system_prompt: str | None = None  # None: the env's own
    groups_per_step: int = 1


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


@dataclass
class Trajectory:
    """One episode: its turns, its token trace and how it ended."""

    tag: str
    group: int
    seed: int
    index: int  # launch order within the group
    turns: list[Turn] = field(default_factory=list)
    trace: TokenTrace = field(default_factory=TokenTrace)
    status: str = "running"  # done | truncated | context | error | timeout | cancelled
    success: bool = False
    episode_return: float = 0.0
    error: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Ended on its own (terminated, truncated, or out of context): usable for training."""
        return self.status in ("done", "truncated", "context")

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
    group_size_redundancy: int = 0
    mode: str = "trajectory"  # trajectory | step
    history_window: int = 2  # step mode: previous (observation, action) turns in the prompt
    max_context: int = 512
    step_timeout_s: float = 30.0
    episode_timeout_s: float = 600.0
    max_replacements: int = 4
    max_concurrent_episodes: int = 64
    chunk_size: int = 8
    max_chunks_in_flight: int = 1
    async_generation_ratio: int = 0
    turn_barrier: bool = False  # the lockstep baseline (benchmarks): see _TurnBarrier
    seed: int = 0


# ---- the request router -----------------------------------------------------------------------
class _Router:
    """Sends generation requests to the least-loaded inference rank in chunks."""

    def __init__(self, infer: Any, params: SamplingParams, chunk_size: int, max_chunks: int):
        self.infer = infer
        self.params = params
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self.cond = threading.Condition()
        self.queue: list[tuple[Request, SamplingParams, Future]] = []
        self.in_flight = [0] * infer.world_size
        self.chunks = [0] * infer.world_size
        self.paused = False
        self.closed = False
        self.gen_busy_s = 0.0
        self.calls = 0
        self._uid = 0
        self.thread = threading.Thread(target=self._loop, name="agentic-router", daemon=True)
        self.thread.start()

    def generate(
        self, prompt_ids: list[int], seed: int, params: SamplingParams | None = None
    ) -> Future:
        future: Future = Future()
        with self.cond:
            if self.closed:
                future.set_exception(EpisodeCancelled("router closed"))
                return future
            self._uid += 1
            self.queue.append((Request(self._uid, prompt_ids, seed), params or self.params, future))
            self.cond.notify_all()
        return future

    def _free_rank(self) -> int | None:
        free = [r for r in range(len(self.chunks)) if self.chunks[r] < self.max_chunks]
        return min(free, key=lambda r: (self.in_flight[r], r)) if free else None

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (
                    self.paused or not self.queue or self._free_rank() is None
                ):
                    self.cond.wait()
                if self.closed:
                    return
                rank = self._free_rank()
                assert rank is not None
                # requests of one chunk share sampling params (validation vs training)
                first = self.queue[0][1]
                chunk = [q for q in self.queue if q[1] == first and not q[2].cancelled()]
                chunk = chunk[: self.chunk_size]
                taken = {id(q) for q in chunk}
                self.queue = [q for q in self.queue if id(q) not in taken and not q[2].cancelled()]
                if not chunk:
                    continue
                self.in_flight[rank] += len(chunk)
                self.chunks[rank] += 1
            start = time.perf_counter()
            future = self.infer.submit(rank, "generate", [q[0] for q in chunk], first)
            future.add_done_callback(
                lambda f, rank=rank, chunk=chunk, start=start: self._done(f, rank, chunk, start)
            )

    def _done(self, future: Future, rank: int, chunk: list, start: float) -> None:
        error: BaseException | None = None
        by_id: dict[int, Completion] = {}
        try:
            by_id = {c.request_id: c for c in future.result()}
        except BaseException as err:  # noqa: BLE001 - handed to the waiting episodes
            cause = getattr(err, "cause", None)
            error = cause if isinstance(cause, RollError) else err
        with self.cond:
            self.in_flight[rank] -= len(chunk)
            self.chunks[rank] -= 1
            self.gen_busy_s += time.perf_counter() - start
            self.calls += 1
            self.cond.notify_all()
        for request, _, waiter in chunk:
            if not waiter.set_running_or_notify_cancel():
                continue  # the episode gave up waiting (cancelled)
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(by_id[request.request_id])

    def suspend(self) -> None:
        """Stop sending requests and wait until no chunk is in flight."""
        with self.cond:
            self.paused = True
            while sum(self.chunks) and not self.closed:
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            pending, self.queue = self.queue, []
            self.cond.notify_all()
        for _, _, waiter in pending:
            if waiter.set_running_or_notify_cancel():
                waiter.set_exception(EpisodeCancelled("router closed"))


def window_prompt(
    chat: ChatFormat, system: str, history: list[tuple[str, str]], observation: str, window: int
) -> list[int]:
    """Step mode: system, the last `window` (observation, action) turns, the observation."""
    messages = first_messages(system, "")[:-1]
    for obs, act in history[-window:] if window else []:
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": act}]
    messages.append({"role": "user", "content": observation})
    return chat.prompt(messages)


def play_episode(
    traj: Trajectory,
    spec: EnvSpec,
    *,
    chat: ChatFormat,
    settings: RolloutSettings,
    max_new_tokens: int,
    generate: Callable[[list[int], int], Completion],
    env_call: Callable[..., Any],
) -> Trajectory:
    """Play one episode into `traj`: observe -> generate -> step until the env ends it.

    `generate(prompt_ids, turn)` returns the completion; `env_call(fn, *args)` calls the env
    (the manager puts timeouts there). Exceptions (env errors, timeouts, cancellation)
    propagate; a prompt that no longer fits `settings.max_context` ends the episode (status
    `context`).
    """
    s = settings
    env = env_call(spec.factory)
    observation, _ = env_call(env.reset, traj.seed)
    system = spec.system_prompt if spec.system_prompt is not None else env.system_prompt
    history: list[tuple[str, str]] = []  # step mode: (observation, action) turns
    traj.trace.add_context(chat.prompt(first_messages(system, observation)))
    while True:
        if s.mode == "step":
            prompt = window_prompt(chat, system, history, observation, s.history_window)
        else:
            prompt = list(traj.trace.ids)
        if len(prompt) + max_new_tokens > s.max_context:
            traj.status = "context"
            return traj
        t0 = time.perf_counter()
        completion = generate(prompt, len(traj.turns))
        gen_s = time.perf_counter() - t0
        action = str(chat.tokenizer.decode(completion.response_ids, skip_special_tokens=True))
        key = str(env_call(env.state_key))
        t1 = time.perf_counter()
        result = env_call(env.step, action)
        env_s = time.perf_counter() - t1
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
            )
        )
        traj.episode_return += float(result.reward)
        traj.success = bool(result.info.get("success", False))
        if result.terminated or result.truncated:
            traj.status = "done" if result.terminated else "truncated"
            return traj
        history.append((observation, action))
        observation = result.observation
        ended_with_eos = bool(completion.response_ids) and (
            completion.response_ids[-1] == chat.eos_id
        )
        reply = chat.env_message(observation, after_eos=ended_with_eos)
        if s.mode != "step" and len(traj.trace.ids) + len(reply) + max_new_tokens > s.max_context:
            traj.status = "context"  # the next turn would not fit: end on the last response
            return traj
        traj.trace.add_context(reply)


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


@dataclass
class _Group:
    gid: int
    spec: EnvSpec
    seed: int
    target: int
    params: SamplingParams
    kept: list[Trajectory] = field(default_factory=list)
    running: list[_Episode] = field(default_factory=list)
    launched: int = 0
    replacements: int = 0
    finished: bool = False
    failed: bool = False
    ended: list[Trajectory] = field(default_factory=list)
    counted: bool = True  # training groups feed the rollout counters; validation ones do not


@dataclass
class AgenticResult:
    groups: list[list[Trajectory]]
    metrics: dict[str, float]


class EnvRolloutManager:
    """Runs env groups on threads against an actor_infer cluster (see the module docstring)."""

    def __init__(
        self,
        *,
        infer: Any,
        tokenizer: Any,
        specs: list[EnvSpec],
        settings: RolloutSettings,
    ) -> None:
        self.infer = infer
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer)
        self.specs = specs
        self.s = settings
        self.router = _Router(
            infer, settings.params, settings.chunk_size, settings.max_chunks_in_flight
        )
        self.pool = ThreadPoolExecutor(
            max_workers=settings.max_concurrent_episodes, thread_name_prefix="episode"
        )
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.next_group_seed = {spec.tag: 0 for spec in specs}
        self._gid = 0
        self.completed: list[_Group] = []
        self.active: list[_Group] = []
        self.fatal: BaseException | None = None
        self.counters: dict[str, float] = {}
        self.first_fault: dict[str, str] = {}  # tag -> the first env fault of the run
        self.version = 0
        self.running: dict[int, _Episode] = {}
        self.barrier = _TurnBarrier() if settings.turn_barrier else None

    # ---- public API ---------------------------------------------------------------------------
    def next_batch(self, step: int) -> AgenticResult:
        """``groups_per_step`` complete groups of every env spec (blocks until they are ready)."""
        start = time.perf_counter()
        busy0, calls0 = self.router.gen_busy_s, self.router.calls
        stale = 0
        want = {spec.tag: spec.groups_per_step for spec in self.specs}
        taken: dict[str, list[_Group]] = {tag: [] for tag in want}
        dropped = 0
        surplus: list[_Group] = []
        extra_budget = {tag: 2 * n + 2 for tag, n in want.items()}
        self._top_up(want, taken)
        while any(len(taken[t]) < want[t] for t in want):
            with self.cond:
                while not self.completed and self.fatal is None:
                    self.cond.wait(timeout=1.0)
                if self.fatal is not None:
                    raise self.fatal
                done, self.completed = self.completed, []
            for group in done:
                tag = group.spec.tag
                if group.failed:
                    dropped += 1
                    extra_budget[tag] -= 1
                    if extra_budget[tag] < 0:
                        raise self._fault_stop(tag, dropped)
                elif (
                    min(t.min_version for t in group.kept)
                    < self.version - self.s.async_generation_ratio
                ):
                    stale += 1
                elif len(taken[tag]) < want[tag]:
                    taken[tag].append(group)
                else:
                    surplus.append(group)  # ahead of need (async): kept for a later step
            self._top_up(want, taken)
        with self.lock:
            self.completed = surplus + self.completed
        for tag in want:  # keep the batch in launch order (reproducible with chunk_size 1)
            taken[tag].sort(key=lambda g: g.gid)
        groups = [sorted(g.kept, key=lambda t: t.index) for tag in want for g in taken[tag]]
        metrics = self._counters_metrics()
        metrics["rollout/groups_dropped_failed"] = float(dropped)
        metrics["rollout/groups_dropped_stale"] = float(stale)
        metrics["rollout/wall_s"] = time.perf_counter() - start
        metrics["rollout/gen_busy_s"] = self.router.gen_busy_s - busy0
        metrics["rollout/gen_calls"] = float(self.router.calls - calls0)
        staleness = [self.version - t.min_version for g in groups for t in g]
        metrics["rollout/staleness_max"] = float(max(staleness, default=0))
        metrics["rollout/staleness_mean"] = sum(staleness) / max(1, len(staleness))
        if self.s.async_generation_ratio > 0:
            self._top_up({t: 0 for t in want}, {t: [] for t in want})  # keep generating
        return AgenticResult(groups=groups, metrics=metrics)

    def run_episodes(
        self, spec: EnvSpec, seeds: list[int], params: SamplingParams
    ) -> list[Trajectory]:
        """One episode per seed (validation): no redundancy, failures are returned as such."""
        groups = [
            self._launch_group(spec, seed, 1, params, redundancy=0, spare=0, counted=False)
            for seed in seeds
        ]
        with self.cond:
            while not all(g.finished for g in groups) and self.fatal is None:
                self.cond.wait(timeout=1.0)
            if self.fatal is not None:
                raise self.fatal
            self.completed = [g for g in self.completed if g not in groups]
        out = []
        for g in groups:
            out.append(g.kept[0] if g.kept else g.ended[-1])
        return out

    def suspend(self) -> None:
        """Before a weight sync: no generation runs until :meth:`resume`."""
        self.router.suspend()

    def resume(self, version: int) -> None:
        self.version = version
        self.router.resume()

    def state_dict(self) -> dict[str, Any]:
        return {"next_group_seed": dict(self.next_group_seed), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_seed.update(state["next_group_seed"])
        self.counters = dict(state.get("counters", {}))

    def close(self) -> None:
        with self.lock:
            episodes = list(self.running.values())
        for ep in episodes:
            ep.cancel.set()
        self.router.close()
        self.pool.shutdown(wait=True, cancel_futures=True)

    # ---- launching ------------------------------------------------------------------------------
    def _top_up(self, want: dict[str, int], taken: dict[str, list[_Group]]) -> None:
        """Launch groups until each spec has enough groups running, ready or taken."""
        ahead = self.s.async_generation_ratio
        for spec in self.specs:
            with self.lock:
                have = sum(1 for g in self.active if g.spec.tag == spec.tag and not g.failed) + sum(
                    1 for g in self.completed if g.spec.tag == spec.tag and not g.failed
                )
            need = want[spec.tag] - len(taken[spec.tag]) + ahead * spec.groups_per_step - have
            for _ in range(max(0, need)):
                seed = self.next_group_seed[spec.tag]
                self.next_group_seed[spec.tag] += 1
                self._launch_group(
                    spec,
                    self._train_seed(spec, seed),
                    self.s.group_size,
                    self.s.params,
                    redundancy=self.s.group_size_redundancy,
                    spare=self.s.max_replacements,
                )

    def _train_seed(self, spec: EnvSpec, k: int) -> int:
        return self.s.seed * 1_000_003 + k

    def _launch_group(
        self,
        spec: EnvSpec,
        seed: int,
        size: int,
        params: SamplingParams,
        *,
        redundancy: int,
        spare: int,
        counted: bool = True,
    ) -> _Group:
        with self.lock:
            self._gid += 1
            group = _Group(self._gid, spec, seed, size, params, counted=counted)
            group.replacements = -spare  # counts up to 0
            self.active.append(group)
            for _ in range(size + redundancy):
                self._launch_episode(group)
        return group

    def _launch_episode(self, group: _Group) -> None:
        """(lock held) Start one more episode of `group` on the pool."""
        traj = Trajectory(
            tag=group.spec.tag, group=group.gid, seed=group.seed, index=group.launched
        )
        group.launched += 1
        ep = _Episode(traj, threading.Event(), group.params)
        group.running.append(ep)
        self.running[id(ep)] = ep
        if self.barrier is not None and group.counted:
            self.barrier.join(id(ep))
        self.pool.submit(self._episode_main, group, ep)

    # ---- one episode ---------------------------------------------------------------------------
    def _episode_main(self, group: _Group, ep: _Episode) -> None:
        start = time.perf_counter()
        try:
            if ep.cancel.is_set():  # its group finished while it waited for a thread
                raise EpisodeCancelled()
            self._play(group, ep, start)
        except EpisodeCancelled:
            ep.traj.status = "cancelled"
        except EnvTimeout as err:
            ep.traj.status, ep.traj.error = "timeout", describe_fault(err)
        except _GenerationFailed as err:
            ep.traj.status, ep.traj.error = "gen_error", str(err.cause)
            with self.cond:
                self.fatal = err.cause
                self.cond.notify_all()
        except Exception as err:  # noqa: BLE001 - an env that raises ends its episode
            ep.traj.status, ep.traj.error = "error", describe_fault(err)
        ep.traj.wall_s = time.perf_counter() - start
        self._episode_ended(group, ep)

    def _play(self, group: _Group, ep: _Episode, start: float) -> None:
        s = self.s
        deadline = start + s.episode_timeout_s

        def remaining() -> float:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise EnvTimeout(f"episode ran past episode_timeout_s={s.episode_timeout_s}")
            return left

        def env_call(fn: Callable[..., Any], *args: Any) -> Any:
            return call_with_timeout(fn, *args, timeout=min(s.step_timeout_s, remaining()))

        def generate(prompt: list[int], turn: int) -> Completion:
            if ep.cancel.is_set():
                raise EpisodeCancelled()
            if self.barrier is not None and group.counted:
                self.barrier.wait(id(ep), turn, ep.cancel)
            seed = hash((group.seed, ep.traj.index, turn, s.seed)) % 2**31
            completion = self._wait(self.router.generate(prompt, seed, ep.params), ep, remaining)
            if ep.cancel.is_set():
                raise EpisodeCancelled()
            return completion

        play_episode(
            ep.traj,
            group.spec,
            chat=self.chat,
            settings=s,
            max_new_tokens=ep.params.max_new_tokens,
            generate=generate,
            env_call=env_call,
        )

    def _wait(self, future: Future, ep: _Episode, remaining: Callable[[], float]) -> Completion:
        while True:
            if ep.cancel.is_set():
                future.cancel()
                raise EpisodeCancelled()
            try:
                result: Completion = future.result(timeout=min(0.5, remaining()))
                return result
            except TimeoutError:
                continue
            except EpisodeCancelled:
                raise
            except BaseException as err:  # noqa: BLE001 - generation failure: fatal for the run
                raise _GenerationFailed(err) from err

    def _episode_ended(self, group: _Group, ep: _Episode) -> None:
        traj = ep.traj
        with self.cond:
            group.running.remove(ep)
            self.running.pop(id(ep), None)
            if self.barrier is not None:
                self.barrier.leave(id(ep))
            group.ended.append(traj)
            if group.counted:
                self._count(traj)
                if traj.status in ("error", "timeout"):
                    self.first_fault.setdefault(traj.tag, traj.error)
            if group.finished:
                pass
            elif traj.ok:
                group.kept.append(traj)
                if len(group.kept) == group.target:
                    group.finished = True
                    for other in group.running:
                        other.cancel.set()
            elif traj.status in ("error", "timeout") and group.replacements < 0:
                group.replacements += 1
                self._count_key(f"rollout/{traj.tag}/env_replaced")
                self._launch_episode(group)
            if not group.finished and not group.running:
                group.finished, group.failed = True, True  # cannot reach its size any more
            if group.finished and group in self.active:
                self.active.remove(group)
                self.completed.append(group)
            self.cond.notify_all()

    def _fault_stop(self, tag: str, failed_groups: int) -> EnvFault:
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

    # ---- counters ----------------------------------------------------------------------------------
    def _count_key(self, key: str, value: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + value

    def _count(self, traj: Trajectory) -> None:
        tag = traj.tag
        if traj.status == "error":
            self._count_key(f"rollout/{tag}/env_errors")
        elif traj.status == "timeout":
            self._count_key(f"rollout/{tag}/env_timeouts")
        elif traj.status == "cancelled":
            self._count_key(f"rollout/{tag}/episodes_cancelled")
        elif traj.ok:
            self._count_key(f"rollout/{tag}/episodes_completed")

    def _counters_metrics(self) -> dict[str, float]:
        """Counters since the last call (then reset)."""
        with self.lock:
            out, self.counters = dict(self.counters), {}
        errors = sum(v for k, v in out.items() if k.endswith("/env_errors"))
        timeouts = sum(v for k, v in out.items() if k.endswith("/env_timeouts"))
        out["rollout/env_errors"] = errors
        out["rollout/env_timeouts"] = timeouts
        return out


class _GenerationFailed(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
