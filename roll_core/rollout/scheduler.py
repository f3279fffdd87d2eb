"""The RLVR rollout producer: one scheduler, synchronous or asynchronous.

* Prompt replication: every prompt becomes `n` independent requests (one per sample), each with
  its own seed.
* Requests go through the rollout router (:mod:`roll_core.rollout.router`): in streaming mode
  (the default) each request on its own to the least-loaded inference rank, answered the moment
  it finishes (optionally every sample of a group on one rank: ``group_affinity``); in
  deterministic mode (``rollout.deterministic``) in fixed chunks of ``chunk_size`` requests in
  pull order, at most ``max_chunks_in_flight`` per rank.
* Queue scheduling: each response is scored on a thread pool the moment it comes back while
  the ranks keep generating; a group is complete when its n samples are scored.
* Dynamic sampling: a group whose rewards have zero variance is dropped and another prompt is
  pulled in its place.
* Every sample records the policy version of the weights that generated it; complete groups
  wait in a :class:`~roll_core.rollout.buffer.FreshnessBuffer`, which only hands out groups
  generated at most ``async_generation_ratio`` weight syncs before the ones being trained.

A background producer thread runs all of it. What ``async_generation_ratio`` changes is only
when prompts are admitted and how groups are handed out:

* **ratio 0 (synchronous)**: the producer admits prompts only while the trainer waits in
  :meth:`RolloutScheduler.next_batch`: that step's ``prompts_per_step`` prompts, plus one
  replacement per group dynamic sampling drops (at most ``max_additional_prompts`` a step).
  The call returns when every group of the step is scored, in prompt order (not completion
  order), so a step is reproducible; nothing generates between steps and nothing is held back.
  Request seeds are ``(seed, step, group of the step, sample)``: a deterministic-mode run
  resumes bit for bit.
* **ratio k >= 1 (async)**: the producer keeps pulling prompts while the trainer trains.
  Admission control (as AReaL's): while the trainer waits for the batch of version ``v`` the
  producer may hold ``(k + 1) * prompts_per_step`` groups it has not handed out (open +
  buffered); once that batch is taken and until the next weight sync, ``k *
  prompts_per_step``. A group started under version ``v`` is then normally trained by step
  ``v + k`` at the latest, so it is fresh when taken; only a group that finishes late (its
  long-tail sample) can still go stale and be dropped. Groups are handed out in completion
  order.

Weight sync (:meth:`RolloutScheduler.sync`): suspend -> update weights -> resume. With
``partial_rollout`` (async, streaming mode) the suspend *aborts* the requests in flight: each
keeps its partial response (tokens, behaviour log-probs, and the policy version of every token),
and after the sync it is re-submitted with ``Request.prefix_ids`` = those tokens, so the engine
continues it under the new weights. The sample's ``policy_version`` is the oldest version of any
of its tokens, ``token_versions`` has one version per token and
``timing["max_policy_version"]`` the newest. Without it (and in deterministic mode) the suspend
waits for the requests in flight to finish with the weights they started with.

Staleness is counted in weight syncs, not in version labels: the weights the producer starts
with are update ``start_version``, and each :meth:`~RolloutScheduler.sync` is one more update,
whatever label the pipeline gives it. The buffer's bound and histogram use these counts, so a
labelling that skips a number (the RLVR loop tags the initial weights ``0`` and those after its
first step ``2``) does not make on-policy groups look one version older and drop them.

Checkpoints: :meth:`~RolloutScheduler.state_dict` records the prompts of groups not yet handed
to the trainer (open or buffered; none at ratio 0); after a resume those prompts are
regenerated first, with the restored weights, then the prompt stream continues. Async runs are
not bit-reproducible across a resume (which group finishes first depends on timing);
synchronous runs in deterministic mode are (docs/runs.md).

The scheduler does not know Ray: it talks to a Cluster of ActorInfer workers through the
router's futures, which both executors provide.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.prompts import Prompt
from roll_core.errors import DataError, RollError
from roll_core.models.routing import extend_routes
from roll_core.rollout.buffer import BufferClosed, FreshnessBuffer
from roll_core.rollout.router import Router


@dataclass
class Sample:
    """One scored response."""

    uid: int
    group: int
    prompt: Prompt
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    policy_version: int
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    """Wall-clock stamps (gen_start/end, reward_start/end) and ``max_policy_version``
    (``policy_version`` is the oldest version)."""
    token_versions: list[int] = field(default_factory=list)
    """The policy version of every response token (partial rollout continues a response across
    weight syncs, so they can differ)."""
    routed_experts: Any = None
    """Router replay: ``[N, L, K]`` routed experts of the first N tokens of prompt + response
    (roll_core/models/routing.py); None when the engine did not record."""


RewardFn = Callable[[Sample], tuple[float, dict[str, Any]]]
"""Scores one sample; must not raise (the reward router turns failures into 0 + a flag)."""


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    metrics: dict[str, float]


def _result(future: Future) -> Any:
    """`future.result()`, with a worker's RollError raised as itself (Ray wraps it)."""
    try:
        return future.result()
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, RollError):
            raise cause from None
        raise


def group_version(group: list[Sample]) -> int:
    """A group is as old as its oldest token: the min ``policy_version`` of its samples."""
    return min(s.policy_version for s in group)


@dataclass
class _Job:
    """One request being generated, possibly continued across weight syncs (partial rollout)."""

    uid: int
    group: int
    prompt: Prompt
    seed: int | None = None
    """Ratio 0: the request's seed, from (seed, step, group of the step, sample); async: None
    (each call's seed comes from (seed, uid, calls))."""
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    calls: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    routed_experts: Any = None
    """Router replay: the routes of the tokens so far (first record of each token wins)."""


class RolloutScheduler:
    """Produces the trainer's groups of `n` scored samples: per call (ratio 0) or ahead of it
    into a freshness buffer (ratio >= 1); see the module docstring."""

    def __init__(
        self,
        *,
        infer: Any,
        prompts: Any,
        reward_fn: RewardFn,
        params: SamplingParams,
        n: int,
        prompts_per_step: int,
        async_generation_ratio: int = 0,
        deterministic: bool = False,
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        group_affinity: bool = False,
        request_timeout_s: float = 1800.0,
        dynamic_sampling: bool = False,
        max_additional_prompts: int = 0,
        reward_workers: int = 4,
        seed: int = 0,
        partial_rollout: bool = False,
        start_version: int = 0,
    ) -> None:
        """``chunk_size`` / ``max_chunks_in_flight``: deterministic mode only;
        ``partial_rollout``: async streaming mode only (a fixed-batch call cannot be aborted,
        and at ratio 0 nothing is in flight at a weight sync)."""
        if async_generation_ratio < 0:
            raise ValueError("async_generation_ratio must be >= 0")
        if partial_rollout and (deterministic or async_generation_ratio == 0):
            raise ValueError("partial rollout aborts requests: async streaming mode only")
        self.infer, self.prompts, self.reward_fn, self.params = infer, prompts, reward_fn, params
        self.n = n
        self.prompts_per_step = prompts_per_step
        self.ratio = async_generation_ratio
        self.deterministic = deterministic
        self.chunk_size = chunk_size
        self.group_affinity = group_affinity
        self.dynamic_sampling = dynamic_sampling
        self.max_additional_prompts = max_additional_prompts
        self.seed = seed
        self.partial_rollout = partial_rollout
        self.router = Router(
            infer,
            deterministic=deterministic,
            chunk_size=chunk_size,
            max_chunks_in_flight=max_chunks_in_flight,
            request_timeout_s=request_timeout_s,
        )
        self.rewards = ThreadPoolExecutor(max_workers=reward_workers, thread_name_prefix="reward")
        self.buffer: FreshnessBuffer[list[Sample]] = FreshnessBuffer(
            async_generation_ratio, version_of=self._group_updates, current_version=start_version
        )
        self._start_updates = start_version
        self._updates = start_version  # weight syncs so far (the version being trained)
        self._update_of: dict[int, int] = {}  # version label -> its update count
        self._cond = threading.Condition()
        self._uid = 0
        self._pulled = 0
        self._requeued: deque[Prompt] = deque()  # prompts of a checkpoint's unfinished groups
        self._open: dict[int, list[Sample]] = {}  # group -> scored samples so far
        self._open_prompts: dict[int, Prompt] = {}
        self._queue: deque[_Job] = deque()
        self._parked: list[_Job] = []  # aborted at a sync, continued after it
        self._futures: dict[Future, tuple[str, Any]] = {}
        # finished futures, in completion order (each future puts itself when done): one
        # wake-up per completion, not a wait() over every pending future each time
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._suspend = False
        self._stop = False
        self._drained = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._dropped_since_handout = 0
        self._taken_for_version = False  # the batch of the current version was handed out
        # ratio 0: the step the trainer waits for (None: admit nothing), the prompts pulled
        # for it, the replacements granted for dropped groups, and "every group is scored"
        self._wanted: int | None = None
        self._step_pulled = self._step_extra = 0
        self._step_done = threading.Event()
        self._reset_counters()

    # ---- trainer side -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the producer thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="rollout", daemon=True)
            self._thread.start()

    def next_batch(self, step: int) -> RolloutResult:
        """``prompts_per_step`` groups generated by weights at most ``ratio`` weight syncs older
        than the ones being trained (``step`` is the loop's step: at ratio 0 it seeds the
        step's requests; the async bound counts the :meth:`sync` calls, see the module
        docstring). Ratio 0: fewer when dynamic sampling dropped more groups than it could
        replace."""
        self.start()
        self.buffer.advance(self._updates)
        with self._cond:
            if self.ratio == 0:
                self._reset_counters()  # the step's rollout starts now
                self._wanted, self._step_pulled, self._step_extra = step, 0, 0
                self._step_done.clear()
            self._cond.notify_all()  # the throttle may have opened
        groups = self._take_step() if self.ratio == 0 else self._take(self.prompts_per_step)
        with self._cond:
            self._dropped_since_handout = 0
            self._taken_for_version = True
            self._wanted = None
            self._cond.notify_all()
            metrics = self._step_metrics(len(groups))
        return RolloutResult(groups=groups, metrics=metrics)

    def _take(self, count: int) -> list[list[Sample]]:
        while True:
            self._raise_if_failed()
            try:
                return self.buffer.get(count, timeout=0.25)
            except TimeoutError:
                continue
            except BufferClosed:
                self._raise_if_failed()
                raise

    def _take_step(self) -> list[list[Sample]]:
        """Ratio 0: once every group of the step is scored, the kept ones in prompt order."""
        while not self._step_done.wait(0.25):
            self._raise_if_failed()
        self._raise_if_failed()
        groups = self._take(len(self.buffer))
        return sorted(groups, key=lambda g: g[0].group)[: self.prompts_per_step]

    def sync(self, update: Any, version: int) -> dict[str, float]:
        """suspend -> ``update()`` (the weight sync; its metrics are returned) -> resume with
        ``version``. Raises what ``update`` raises (after resuming)."""
        start = time.perf_counter()
        self.suspend()
        suspended = time.perf_counter()
        try:
            result = update()
            out = dict(result) if isinstance(result, dict) else {}
        finally:
            self.resume(version)
        out["async/suspend_s"] = suspended - start
        out["async/sync_pause_s"] = time.perf_counter() - start
        return out

    def suspend(self) -> None:
        """Stop sending requests and return once none is in flight: with partial rollout the
        ones in flight are aborted (kept as partial responses), else they finish."""
        self.start()
        with self._cond:
            self._suspend = True
            self._drained.clear()
            in_flight = [job.uid for kind, job in self._futures.values() if kind == "gen"]
            self._cond.notify_all()
        if self.partial_rollout:
            self.router.abort(in_flight)
            self._c["aborted"] += len(in_flight)
        while not self._drained.wait(0.25):
            self._raise_if_failed()

    def resume(self, version: int) -> None:
        """Resume generating with the weights of ``version``: requests aborted at the suspend
        continue from their partial response (partial rollout), first."""
        with self._cond:
            for job in self._parked:
                if job.response_ids:
                    self._c["partial_continued"] += 1
            self._queue.extendleft(reversed(self._parked))
            self._parked = []
            self._updates += 1
            self._update_of[version] = self._updates  # before any call with these weights
            self._suspend = False
            self._taken_for_version = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.buffer.close()
        self.router.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.rewards.shutdown(wait=True, cancel_futures=True)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Prompts of the groups not yet handed out (buffered, open, re-queued), in pull order;
        a resume regenerates them first. Empty at ratio 0: every group of a step is trained on
        in that step (the prompt position is the prompt stream's state)."""
        if self.ratio == 0:
            return {}
        with self._cond:
            buffered = [g[0].prompt.index for g in self.buffer.snapshot()]
            open_ = [self._open_prompts[g].index for g in sorted(self._open_prompts)]
            pending = [p.index for p in self._requeued]
            return {"regenerate": buffered + open_ + pending, "uid": self._uid}

    def load_state_dict(self, state: dict[str, Any], prompts: list[Prompt]) -> None:
        """Restore before :meth:`start`; ``prompts`` are the training prompts by index."""
        if not state:
            return
        self._uid = int(state["uid"])
        by_index = {p.index: p for p in prompts}
        self._requeued = deque(by_index[i] for i in state["regenerate"])

    # ---- the producer -----------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    if not self._suspend:
                        self._pull_prompts()
                        self._dispatch()
                    if self._wanted is not None and not self._suspend and not self._open:
                        self._step_done.set()  # ratio 0: every group of the step is scored
                    gen_busy = any(k == "gen" for k, _ in self._futures.values())
                    if self._suspend and not gen_busy:
                        self._drained.set()
                    if not self._futures:
                        self._cond.wait(0.05)
                        continue
                done = self._finished(timeout=0.05)
                with self._cond:
                    for future in done:
                        kind, payload = self._futures.pop(future)
                        if kind == "gen":
                            self._on_generated(future, payload)
                        else:
                            self._on_scored(_result(future))
        except BaseException as err:  # surfaced to the trainer by next_batch / suspend
            self._error = err
            self.buffer.close()
            self._drained.set()
            self._step_done.set()

    def _finished(self, timeout: float) -> list[Future]:
        """The futures that finished since the last call, waiting up to `timeout` for one."""
        try:
            done = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def _watch(self, future: Future, entry: tuple[str, Any]) -> None:
        self._futures[future] = entry
        future.add_done_callback(self._done.put)

    def _group_updates(self, group: list[Sample]) -> int:
        """The update count of the group's oldest weights (labels not synced here: the
        weights the producer started with)."""
        return self._update_of.get(group_version(group), self._start_updates)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _pull_prompts(self) -> None:
        """Admit prompts: ratio 0, the waited-for step's (see the module docstring); async, up
        to the admission limit."""
        if self.ratio == 0:
            while self._wanted is not None and self._step_pulled < (
                self.prompts_per_step + self._step_extra
            ):
                if not self._pull_one():
                    return
            return
        limit = (self.ratio + 1 - self._taken_for_version) * self.prompts_per_step
        while len(self._open) + len(self.buffer) < limit:
            if self._dropped_since_handout > self.prompts_per_step + self.max_additional_prompts:
                raise DataError(
                    "async rollout: dynamic sampling dropped every group "
                    f"({self._dropped_since_handout} in a row) before a batch was full.",
                    hint="Raise rollout.max_additional_prompts or turn "
                    "algorithm.dynamic_sampling off.",
                )
            if not self._pull_one():
                return

    def _pull_one(self) -> bool:
        """Open a group for the next prompt (a checkpoint's re-queued ones first) and queue its
        n requests; False when the prompt stream is exhausted."""
        if self._requeued:
            prompt = self._requeued.popleft()
        else:
            try:
                prompt = next(self.prompts)
            except StopIteration:
                return False
        group = self._pulled
        self._pulled += 1
        self._open[group] = []
        self._open_prompts[group] = prompt
        if self.ratio == 0 and self._step_pulled >= self.prompts_per_step:
            self._c["additional"] += 1  # in place of a dropped group
        for k in range(self.n):
            self._uid += 1
            seed = None
            if self.ratio == 0:
                seed = hash((self.seed, self._wanted, self._step_pulled, k)) % 2**31
            self._queue.append(_Job(self._uid, group, prompt, seed))
        self._step_pulled += 1
        return True

    def _request(self, job: _Job) -> tuple[Request, SamplingParams]:
        """The request that continues ``job`` (from its prefix, with the tokens left)."""
        seed = job.seed if job.seed is not None else hash((self.seed, job.uid, job.calls)) % 2**31
        request = Request(
            job.uid,
            job.prompt.prompt_ids,
            seed,
            prefix_ids=list(job.response_ids),
            vision=job.prompt.vision,
        )
        room = self.params.max_new_tokens - len(job.response_ids)
        return request, replace(self.params, max_new_tokens=room)

    def _dispatch(self) -> None:
        """Send every queued request (the engines batch them; admission control bounds how
        many there are). Deterministic: in fixed chunks of chunk_size, in queue order."""
        jobs, self._queue = list(self._queue), deque()
        if not jobs:
            return
        submitted = time.time()
        if self.deterministic:
            for i in range(0, len(jobs), self.chunk_size):
                chunk = jobs[i : i + self.chunk_size]
                calls = [self._request(j) for j in chunk]
                futures = self.router.submit_batch([r for r, _ in calls], calls[0][1])
                self._track(chunk, futures, submitted)
            return
        futures = []
        for job in jobs:
            request, params = self._request(job)
            session = job.group if self.group_affinity else None
            futures.append(self.router.submit(request, params, session=session))
        self._track(jobs, futures, submitted)

    def _track(self, jobs: list[_Job], futures: list[Future], submitted: float) -> None:
        for job, future in zip(jobs, futures, strict=True):
            job.calls += 1
            job.timing.setdefault("gen_start", submitted)
            self._watch(future, ("gen", job))

    def _on_generated(self, future: Future, job: _Job) -> None:
        c: Completion = _result(future)
        job.response_ids += c.response_ids
        job.log_probs += c.log_probs
        job.token_versions += [c.policy_version] * len(c.response_ids)
        job.routed_experts = extend_routes(job.routed_experts, c.routed_experts)
        job.timing["gen_end"] = c.timing.get("gen_end", time.time())
        self._gen_ends.append(job.timing["gen_end"])
        if c.finish_reason == "abort":
            self._parked.append(job)  # continued after the sync, from its prefix
        elif not job.token_versions:  # an empty response: as old as the call's weights
            self._finish(job, c.finish_reason, c.policy_version)
        else:
            self._finish(job, c.finish_reason, min(job.token_versions))

    def _finish(self, job: _Job, reason: str, version: int) -> None:
        sample = Sample(
            uid=job.uid,
            group=job.group,
            prompt=job.prompt,
            response_ids=job.response_ids,
            log_probs=job.log_probs,
            finish_reason=reason,
            policy_version=version,
            token_versions=job.token_versions,
            timing=dict(job.timing),
            routed_experts=job.routed_experts,
        )
        sample.timing["max_policy_version"] = float(max(job.token_versions, default=version))
        if len(set(job.token_versions)) > 1:
            self._c["partial_samples"] += 1
        self._c["samples"] += 1
        self._watch(self.rewards.submit(self._score, sample), ("reward", sample))

    def _score(self, sample: Sample) -> Sample:
        sample.timing["reward_start"] = time.time()
        sample.reward, sample.reward_info = self.reward_fn(sample)
        sample.timing["reward_end"] = time.time()
        return sample

    def _on_scored(self, sample: Sample) -> None:
        self._c["reward_s"] += sample.timing["reward_end"] - sample.timing["reward_start"]
        self._reward_starts.append(sample.timing["reward_start"])
        group = self._open[sample.group]
        group.append(sample)
        if len(group) < self.n:
            return
        del self._open[sample.group]
        del self._open_prompts[sample.group]
        if self.group_affinity:
            self.router.release(sample.group)
        rewards = [x.reward for x in group]
        if self.dynamic_sampling and max(rewards) == min(rewards):
            self._c["groups_dropped"] += 1
            self._dropped_since_handout += 1
            if self.ratio == 0 and self._step_extra < self.max_additional_prompts:
                # its replacement is requested at once, as its own call (reproducible chunks)
                self._step_extra += 1
                self._pull_prompts()
                self._dispatch()
            return
        self.buffer.put(sorted(group, key=lambda x: x.uid))

    # ---- metrics ----------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        keys = ("samples", "groups_dropped", "additional", "aborted", "partial_continued",
                "partial_samples", "reward_s")  # fmt: skip
        self._c: dict[str, float] = dict.fromkeys(keys, 0.0)
        self._gen_ends: list[float] = []
        self._reward_starts: list[float] = []
        self._since = time.perf_counter()
        self._router0 = dict(self.router.stats) | {"active_s": self.router.active_seconds()}

    def _step_metrics(self, kept: int) -> dict[str, float]:
        """Counters since the previous ``next_batch`` (at ratio 0: since this one began; call
        under ``self._cond``)."""
        now = time.perf_counter()
        c = dict(self._c)
        wall = max(1e-9, now - self._since)
        active = self.router.active_seconds() - self._router0["active_s"]
        last_gen = max(self._gen_ends, default=0.0)
        out = {
            "rollout/groups_kept": float(kept),
            "rollout/groups_dropped": c["groups_dropped"],
            "rollout/samples_generated": c["samples"],
            "rollout/wall_s": wall,
            "rollout/reward_s": c["reward_s"],
            "rollout/rewards_before_last_gen": float(
                sum(1 for t in self._reward_starts if t < last_gen)
            ),
            "rollout/gen_active_s": active,
            "rollout/gen_idle_fraction": max(0.0, 1.0 - active / wall),
            "rollout/gen_calls": self.router.stats["calls"] - self._router0["calls"],
        }
        if self.ratio == 0:
            out["rollout/additional_prompts"] = c["additional"]
        else:
            out |= {
                "async/aborted_requests": c["aborted"],
                "async/partial_continued": c["partial_continued"],
                "async/partial_samples": c["partial_samples"],
            }
            out |= self.buffer.metrics("async/")
        self._reset_counters()
        return out
