"""RLVR's rollout: a prompt is a one-turn episode group of ``n`` samples, scored by the reward
stage, produced by the one rollout producer (:mod:`roll_core.rollout.producer`).

* Prompt replication: every prompt becomes ``n`` independent requests (one per sample), each
  with its own seed: ratio 0, ``(seed, step, group of the step, sample)``, so a
  deterministic-mode run resumes bit for bit; async, ``(seed, uid, call)``.
* Requests go through the rollout router (:mod:`roll_core.rollout.router`): in streaming mode
  (the default) each request on its own to the least-loaded inference rank, answered the moment
  it finishes (optionally every sample of a group on one rank: ``group_affinity``); in
  deterministic mode (``rollout.deterministic``) the requests of the groups one admission opens
  go as fixed chunks of ``chunk_size`` in admission order, at most ``max_chunks_in_flight`` per
  rank (a group dynamic sampling admits in place of a dropped one is its own chunk).
* Queue scheduling: each response is scored on a thread pool the moment it comes back while
  the ranks keep generating; a group is complete when its ``n`` samples are scored.
* Partial rollout (``partial_rollout``, async streaming mode): a weight sync *aborts* the
  requests in flight; each keeps its partial response (tokens, behaviour log-probs, the policy
  version of every token) and is sent again at once with ``Request.prefix_ids`` = those tokens;
  the router holds it until the sync is over, so the engine continues it under the new weights.
  The sample's ``policy_version`` is the oldest version of any of its tokens,
  ``token_versions`` has one version per token and ``timing["max_policy_version"]`` the newest.
  Without it (and in deterministic mode) a sync waits for the requests in flight to finish
  with the weights they started with.

Checkpoints: an async run's state is the prompts of the groups not yet handed to the trainer
(buffered, running, re-queued), in admission order; after a resume those prompts are
regenerated first, with the restored weights, then the prompt stream continues. Async runs are
not bit-reproducible across a resume (which group finishes first depends on timing);
synchronous runs in deterministic mode are (docs/runs.md).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.prompts import Prompt
from roll_core.errors import RollError
from roll_core.models.routing import extend_routes
from roll_core.rollout.producer import Group, Members, RolloutProducer
from roll_core.rollout.router import Router, RouterClosed

TAG = "prompts"
"""The one tag of RLVR groups."""


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


def group_version(group: list[Sample]) -> int:
    """A group is as old as its oldest token: the min ``policy_version`` of its samples."""
    return min(s.policy_version for s in group)


def _result(future: Future) -> Any:
    """`future.result()`, with a worker's RollError raised as itself (Ray wraps it)."""
    try:
        return future.result()
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, RollError):
            raise cause from None
        raise


@dataclass(eq=False)
class _Job:
    """One request being generated, possibly continued across weight syncs (partial rollout)."""

    uid: int
    group: Group[Sample]
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


class OneTurnMembers(Members[Sample]):
    """The ``n`` scored samples of a prompt (see the module docstring)."""

    unit = "prompts"

    def __init__(
        self,
        *,
        infer: Any,
        prompts: Iterator[Prompt],
        reward_fn: RewardFn,
        params: SamplingParams,
        ratio: int,
        deterministic: bool = False,
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        group_affinity: bool = False,
        request_timeout_s: float = 1800.0,
        reward_workers: int = 4,
        seed: int = 0,
        partial_rollout: bool = False,
        by_index: Sequence[Prompt] | None = None,
    ) -> None:
        self.prompts, self.reward_fn, self.params = prompts, reward_fn, params
        self.ratio = ratio
        self.deterministic = deterministic
        self.chunk_size = chunk_size
        self.group_affinity = group_affinity
        self.seed = seed
        self.abort_on_suspend = partial_rollout
        self.by_index = by_index or []  # the training prompts by index (restoring a checkpoint)
        self.router = Router(
            infer,
            deterministic=deterministic,
            chunk_size=chunk_size,
            max_chunks_in_flight=max_chunks_in_flight,
            request_timeout_s=request_timeout_s,
        )
        self.pool = ThreadPoolExecutor(max_workers=reward_workers, thread_name_prefix="reward")
        self._uid = 0
        self._requeued: deque[Prompt] = deque()  # prompts of a checkpoint's unfinished groups
        self._jobs: dict[int, list[_Job]] = {}  # group id -> its jobs (cancelling)
        self._closed = False
        self.begin_step()

    # ---- the producer's calls ----------------------------------------------------------------
    def next_key(self, tag: str) -> Prompt | None:
        if self._requeued:
            return self._requeued.popleft()
        return next(self.prompts, None)

    def launch(self, groups: list[Group[Sample]]) -> None:
        jobs = []
        for group in groups:
            group_jobs = []
            for k in range(group.size):
                self._uid += 1
                seed = None
                if self.ratio == 0:
                    seed = hash((self.seed, group.step, group.index, k)) % 2**31
                group_jobs.append(_Job(self._uid, group, seed))
            self._jobs[group.gid] = group_jobs
            jobs += group_jobs
        self._dispatch(jobs)

    def cancel(self, group: Group[Sample]) -> None:
        self.router.abort([job.uid for job in self._jobs.pop(group.gid, [])])

    def version(self, group: Group[Sample]) -> int:
        return group_version(group.kept)

    def rewards(self, group: Group[Sample]) -> list[float]:
        return [s.reward for s in group.kept]

    def ordered(self, group: Group[Sample]) -> list[Sample]:
        return sorted(group.kept, key=lambda s: s.uid)

    def state_dict(self, pending: list[Group[Sample]]) -> dict[str, Any]:
        """Prompts of the groups not yet handed out, in admission order (a resume regenerates
        them first). Empty at ratio 0: every group of a step is trained on in that step (the
        prompt position is the prompt stream's state)."""
        if self.ratio == 0:
            return {}
        regenerate = [g.key.index for g in pending] + [p.index for p in self._requeued]
        return {"regenerate": regenerate, "uid": self._uid}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._uid = int(state["uid"])
        by_index = {p.index: p for p in self.by_index}
        self._requeued = deque(by_index[i] for i in state["regenerate"])

    def close(self) -> None:
        with self.producer.cond:
            self._closed = True
        self.router.close()
        self.pool.shutdown(wait=True, cancel_futures=True)

    # ---- requests ----------------------------------------------------------------------------
    def _request(self, job: _Job) -> tuple[Request, SamplingParams]:
        """The request that continues ``job`` (from its prefix, with the tokens left)."""
        seed = job.seed if job.seed is not None else hash((self.seed, job.uid, job.calls)) % 2**31
        prompt: Prompt = job.group.key
        request = Request(
            job.uid,
            prompt.prompt_ids,
            seed,
            prefix_ids=list(job.response_ids),
            vision=prompt.vision,
        )
        params = job.group.options or self.params
        room = params.max_new_tokens - len(job.response_ids)
        return request, replace(params, max_new_tokens=room)

    def _dispatch(self, jobs: list[_Job]) -> None:
        """(lock held) Send the requests (the engines batch them; admission bounds how many
        there are). Deterministic: in fixed chunks of chunk_size, in admission order."""
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
            session = job.group.gid if self.group_affinity else None
            futures.append(self.router.submit(request, params, session=session))
        self._track(jobs, futures, submitted)

    def _track(self, jobs: list[_Job], futures: list[Future], submitted: float) -> None:
        for job, future in zip(jobs, futures, strict=True):
            job.calls += 1
            job.timing.setdefault("gen_start", submitted)
            future.add_done_callback(functools.partial(self._handle, job))

    def _handle(self, job: _Job, future: Future) -> None:
        """A request's future resolved (any thread): its result is handled on the pool."""
        with contextlib.suppress(RuntimeError):  # the pool was shut down: the run is closing
            self.pool.submit(self._on_generated, job, future)

    def _on_generated(self, job: _Job, future: Future) -> None:
        try:
            c: Completion = _result(future)
        except RouterClosed:
            return
        except BaseException as err:  # noqa: BLE001 - a generation failure ends the run
            self.producer.fail(err)
            return
        with self.producer.cond:
            if self._closed or job.group.abandoned:
                return
            job.response_ids += c.response_ids
            job.log_probs += c.log_probs
            job.token_versions += [c.policy_version] * len(c.response_ids)
            job.routed_experts = extend_routes(job.routed_experts, c.routed_experts)
            job.timing["gen_end"] = c.timing.get("gen_end", time.time())
            self._gen_ends.append(job.timing["gen_end"])
            if c.finish_reason == "abort":  # a sync aborted it: continued from its prefix
                self._c["aborted"] += 1
                if job.response_ids:
                    self._c["partial_continued"] += 1
                self._dispatch([job])  # the router holds it until the sync is over
                return
            version = min(job.token_versions) if job.token_versions else c.policy_version
            sample = self._sample(job, c.finish_reason, version)
        try:
            sample.timing["reward_start"] = time.time()
            sample.reward, sample.reward_info = self.reward_fn(sample)
            sample.timing["reward_end"] = time.time()
        except BaseException as err:  # noqa: BLE001 - the reward stage must not raise
            self.producer.fail(err)
            return
        self._on_scored(job.group, sample)

    def _sample(self, job: _Job, reason: str, version: int) -> Sample:
        """(lock held) The finished response of ``job``."""
        sample = Sample(
            uid=job.uid,
            group=job.group.gid,
            prompt=job.group.key,
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
        return sample

    def _on_scored(self, group: Group[Sample], sample: Sample) -> None:
        with self.producer.cond:
            if self._closed or group.abandoned:
                return
            self._c["reward_s"] += sample.timing["reward_end"] - sample.timing["reward_start"]
            self._reward_starts.append(sample.timing["reward_start"])
            group.kept.append(sample)
            if len(group.kept) < group.size:
                return
            del self._jobs[group.gid]
            if self.group_affinity:
                self.router.release(group.gid)
            self.producer.group_ended(group)

    # ---- metrics -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        keys = ("samples", "aborted", "partial_continued", "partial_samples", "reward_s")
        self._c: dict[str, float] = dict.fromkeys(keys, 0.0)
        self._gen_ends: list[float] = []
        self._reward_starts: list[float] = []

    def step_metrics(self, groups: list[Group[Sample]]) -> dict[str, float]:
        c = self._c
        last_gen = max(self._gen_ends, default=0.0)
        out = {
            "rollout/samples_generated": c["samples"],
            "rollout/reward_s": c["reward_s"],
            "rollout/rewards_before_last_gen": float(
                sum(1 for t in self._reward_starts if t < last_gen)
            ),
        }
        if self.ratio > 0:
            out |= {
                "async/aborted_requests": c["aborted"],
                "async/partial_continued": c["partial_continued"],
                "async/partial_samples": c["partial_samples"],
            }
        self.begin_step()
        return out


def prompt_producer(
    *,
    infer: Any,
    prompts: Iterator[Prompt],
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
    by_index: Sequence[Prompt] | None = None,
) -> RolloutProducer[Sample]:
    """The rollout producer of RLVR prompts: groups of ``n`` scored samples.
    ``chunk_size`` / ``max_chunks_in_flight``: deterministic mode only; ``partial_rollout``:
    async streaming mode only (a fixed-batch call cannot be aborted, and at ratio 0 nothing is
    in flight at a weight sync)."""
    if partial_rollout and (deterministic or async_generation_ratio == 0):
        raise ValueError("partial rollout aborts requests: async streaming mode only")
    members = OneTurnMembers(
        infer=infer,
        prompts=prompts,
        reward_fn=reward_fn,
        params=params,
        ratio=async_generation_ratio,
        deterministic=deterministic,
        chunk_size=chunk_size,
        max_chunks_in_flight=max_chunks_in_flight,
        group_affinity=group_affinity,
        request_timeout_s=request_timeout_s,
        reward_workers=reward_workers,
        seed=seed,
        partial_rollout=partial_rollout,
        by_index=by_index,
    )
    return RolloutProducer(
        members,
        per_step={TAG: prompts_per_step},
        size=n,
        async_generation_ratio=async_generation_ratio,
        dynamic_sampling=dynamic_sampling,
        max_additional=max_additional_prompts,
        start_version=start_version,
    )
