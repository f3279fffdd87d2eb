"""Async rollout (``rollout.async_generation_ratio > 0``): generation keeps running while the
trainer trains.

A background producer thread runs the same sample-level machinery as the synchronous
scheduler (prompt replication, chunked least-loaded routing, rewards on a thread pool as
responses finish, dynamic sampling) without a per-step barrier: it keeps pulling prompts and
puts every complete group into a :class:`~roll_core.rollout.buffer.FreshnessBuffer`. The
trainer's :meth:`AsyncRolloutScheduler.next_batch` takes ``prompts_per_step`` groups from the
buffer, which only hands out groups generated at most ``async_generation_ratio`` policy
versions before the one being trained (see ``buffer.py`` for the exact bound).

* Admission control (as AReaL's): while the trainer waits for the batch of version ``v`` the
  producer may hold ``(ratio + 1) * prompts_per_step`` groups it has not handed out (open +
  buffered); once that batch is taken and until the next weight sync, ``ratio *
  prompts_per_step``. A group started under version ``v`` is then normally trained by step
  ``v + ratio`` at the latest, so it is fresh when taken; only a group that finishes late
  (its long-tail sample) can still go stale and be dropped.
* Segments: a request is generated ``segment_tokens`` tokens per backend call and continued
  from its prefix (``Request.prefix_ids``) until it stops or reaches ``max_new_tokens``. The
  segment is the granularity of a weight sync.
* Weight sync (:meth:`sync`): suspend (no new calls; wait for the calls in flight, each at
  most one segment) -> update weights -> resume. Requests left unfinished at the sync are,
  by recipe choice, continued from their prefix with the new weights (``partial_rollout``:
  the prefix keeps its behaviour log-probs, the sample records the oldest and newest version
  that generated it, and its ``policy_version`` is the oldest) or aborted and re-queued from
  the prompt (the default; their tokens are discarded and counted).
* Staleness is counted in weight syncs, not in version labels: the weights the producer
  starts with are update ``start_version``, and each :meth:`sync` is one more update, whatever
  label the pipeline gives it. The buffer's bound and histogram use these counts, so a
  labelling that skips a number (the RLVR loop tags the initial weights ``0`` and those after
  its first step ``2``) does not make on-policy groups look one version older and drop them.
* Tail batching (RollPacker, arXiv 2509.21009, optional): a response that reaches
  ``tail_length_budget`` tokens unfinished is set aside; set-aside responses are continued
  together in a long round once ``tail_round_size`` of them wait (or when nothing else is
  left to generate), so short rounds do not wait on the long tail. Departure: RollPacker
  decides the short/long split per prompt with speculative over-provisioning; here it is per
  response, by a token budget.
* Checkpoints: :meth:`state_dict` records the prompts of groups not yet handed to the trainer
  (open or buffered); after a resume those prompts are regenerated first, with the restored
  weights, then the prompt stream continues. Async runs are not bit-reproducible across a
  resume (which group finishes first depends on timing); synchronous runs are.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.errors import ConfigError, DataError
from roll_core.rollout.buffer import BufferClosed, FreshnessBuffer
from roll_core.rollout.scheduler import Prompt, RewardFn, RolloutResult, Sample, _result


def group_version(group: list[Sample]) -> int:
    """A group is as old as its oldest token: the min ``policy_version`` of its samples."""
    return min(s.policy_version for s in group)


@dataclass
class _Job:
    """One request being generated, possibly over several segments and weight versions."""

    uid: int
    group: int
    prompt: Prompt
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    timing: dict[str, float] = field(default_factory=dict)


def check_prefix_support(
    backend: str, supported: bool, *, partial_rollout: bool, allow_fallback: bool
) -> bool:
    """Whether partial rollout is used: True when asked for and the backend can continue from a
    prefix; False (abort and re-queue) when the recipe allows the fallback; else ConfigError."""
    if not partial_rollout or supported:
        return partial_rollout
    if allow_fallback:
        return False
    raise ConfigError(
        f"rollout.partial_rollout is on, but actor_infer.backend={backend!r} cannot continue a "
        "response from its generated prefix.",
        hint="Turn rollout.partial_rollout off (requests in flight at a weight sync are then "
        "aborted and re-queued), set rollout.partial_rollout_fallback=true to allow that "
        "fallback, or use a backend that continues from a prefix (hf).",
    )


def _resolve(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rollout_placement(
    *,
    ratio: int,
    executor: str,
    train_device: str,
    infer_device: str,
    train_gpus: list[int] | None = None,
    infer_gpus: list[int] | None = None,
) -> str:
    """How rollout and training are placed, in words (the dry-run prints it); ConfigError for
    an async recipe that puts both on one accelerator, where they cannot overlap.

    Async mode is disaggregated: generation runs in its own worker (its own thread in the
    local executor, its own Ray actor in the ray executor) on its own device. On CPU the two
    share the host's cores: they run concurrently but compete for the same cores.
    """
    train, infer = _resolve(train_device), _resolve(infer_device)
    if ratio == 0:
        where = "colocated" if train == infer else "separate devices"
        return f"sync: {where}, generate then train (no overlap)"
    overlap_gpus = sorted(set(train_gpus or []) & set(infer_gpus or []))
    one_gpu = train == infer == "cuda" and (executor == "local" or overlap_gpus)
    if one_gpu:
        on = f"GPU(s) {overlap_gpus}" if overlap_gpus else "the one CUDA device of this process"
        raise ConfigError(
            f"rollout.async_generation_ratio={ratio} asks generation to run while training "
            f"trains, but the recipe colocates actor_infer and actor_train on {on}: both would "
            "time-share one device (and its memory), so they cannot overlap and async would "
            "only add staleness.",
            hint="Give actor_infer and actor_train different devices (executor.type=ray with "
            "non-overlapping device_mapping, or actor_infer.device=cpu for a test), or set "
            "rollout.async_generation_ratio=0 to train synchronously.",
        )
    if train == infer == "cpu":
        return (
            f"async (ratio {ratio}): disaggregated workers on the CPU; generation and "
            "training overlap in time but share the host's cores"
        )
    return f"async (ratio {ratio}): disaggregated, rollout on {infer}, training on {train}"


class AsyncRolloutScheduler:
    """Keeps generating groups into a freshness buffer; the trainer takes them per step."""

    def __init__(
        self,
        *,
        infer: Any,
        prompts: Any,
        reward_fn: RewardFn,
        params: SamplingParams,
        n: int,
        prompts_per_step: int,
        async_generation_ratio: int,
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        dynamic_sampling: bool = False,
        max_additional_prompts: int = 0,
        reward_workers: int = 4,
        seed: int = 0,
        partial_rollout: bool = False,
        segment_tokens: int | None = None,
        tail_length_budget: int | None = None,
        tail_round_size: int | None = None,
        start_version: int = 0,
    ) -> None:
        if async_generation_ratio < 1:
            raise ValueError("AsyncRolloutScheduler needs async_generation_ratio >= 1")
        self.infer = infer
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.params = params
        self.n = n
        self.prompts_per_step = prompts_per_step
        self.ratio = async_generation_ratio
        self.chunk_size = chunk_size
        self.max_chunks_in_flight = max_chunks_in_flight
        self.dynamic_sampling = dynamic_sampling
        self.max_additional_prompts = max_additional_prompts
        self.seed = seed
        self.partial_rollout = partial_rollout
        self.segment = min(segment_tokens or params.max_new_tokens, params.max_new_tokens)
        self.tail_budget = tail_length_budget
        self.tail_round_size = tail_round_size or chunk_size
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
        self._tail: list[_Job] = []
        self._futures: dict[Future, tuple[str, Any]] = {}
        self._in_flight = [0] * infer.world_size
        self._chunks = [0] * infer.world_size
        self._suspend = False
        self._stop = False
        self._drained = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._dropped_since_handout = 0
        self._taken_for_version = False  # the batch of the current version was handed out
        self._reset_counters()

    # ---- trainer side -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the producer thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="rollout", daemon=True)
            self._thread.start()

    def next_batch(self, step: int) -> RolloutResult:
        """``prompts_per_step`` groups generated by weights at most ``ratio`` weight syncs older
        than the ones being trained (``step`` is the loop's step, for the caller's logs: the
        bound counts the :meth:`sync` calls, see the module docstring)."""
        self.start()
        self.buffer.advance(self._updates)
        with self._cond:
            self._cond.notify_all()  # the throttle may have opened
        while True:
            self._raise_if_failed()
            try:
                groups = self.buffer.get(self.prompts_per_step, timeout=0.25)
                break
            except TimeoutError:
                continue
            except BufferClosed:
                self._raise_if_failed()
                raise
        with self._cond:
            self._dropped_since_handout = 0
            self._taken_for_version = True
            self._cond.notify_all()
            metrics = self._step_metrics()
        return RolloutResult(groups=groups, metrics=metrics)

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
        """Stop dispatching and wait until no generation call is in flight."""
        self.start()
        with self._cond:
            self._suspend = True
            self._drained.clear()
            self._cond.notify_all()
        while not self._drained.wait(0.25):
            self._raise_if_failed()

    def resume(self, version: int) -> None:
        """Resume generating with the weights of ``version``: unfinished requests continue from
        their prefix (partial rollout) or restart from their prompt (abort and re-queue)."""
        with self._cond:
            for job in list(self._queue) + self._tail:
                if not job.response_ids:
                    continue
                if self.partial_rollout:
                    self._c["partial_continued"] += 1
                else:
                    self._c["aborted"] += 1
                    self._c["aborted_tokens"] += len(job.response_ids)
                    job.response_ids, job.log_probs, job.versions = [], [], []
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
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.rewards.shutdown(wait=True, cancel_futures=True)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Prompts of the groups not yet handed out (buffered, open, re-queued), in pull order;
        a resume regenerates them first."""
        with self._cond:
            buffered = [g[0].prompt.index for g in self.buffer.snapshot()]
            open_ = [self._open_prompts[g].index for g in sorted(self._open_prompts)]
            pending = [p.index for p in self._requeued]
            return {"regenerate": buffered + open_ + pending, "uid": self._uid}

    def load_state_dict(self, state: dict[str, Any], prompts: list[Prompt]) -> None:
        """Restore before :meth:`start`; ``prompts`` are the training prompts by index."""
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
                    gen_busy = any(k == "gen" for k, _ in self._futures.values())
                    if self._suspend and not gen_busy:
                        self._drained.set()
                    if not self._suspend:
                        self._pull_prompts()
                        self._dispatch()
                    if not self._futures:
                        self._cond.wait(0.05)
                        continue
                done, _ = wait(list(self._futures), timeout=0.05, return_when=FIRST_COMPLETED)
                with self._cond:
                    for future in done:
                        kind, payload = self._futures.pop(future)
                        if kind == "gen":
                            self._on_generated(future, *payload)
                        else:
                            self._on_scored(_result(future))
        except BaseException as err:  # surfaced to the trainer by next_batch / suspend
            self._error = err
            self.buffer.close()
            self._drained.set()

    def _group_updates(self, group: list[Sample]) -> int:
        """The update count of the group's oldest weights (labels not synced here: the
        weights the producer started with)."""
        return self._update_of.get(group_version(group), self._start_updates)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _pull_prompts(self) -> None:
        limit = (self.ratio + 1 - self._taken_for_version) * self.prompts_per_step
        while len(self._open) + len(self.buffer) < limit:
            if self._dropped_since_handout > self.prompts_per_step + self.max_additional_prompts:
                raise DataError(
                    "async rollout: dynamic sampling dropped every group "
                    f"({self._dropped_since_handout} in a row) before a batch was full.",
                    hint="Raise rollout.max_additional_prompts or turn "
                    "algorithm.dynamic_sampling off.",
                )
            if self._requeued:
                prompt = self._requeued.popleft()
            else:
                try:
                    prompt = next(self.prompts)
                except StopIteration:
                    return
            group = self._pulled
            self._pulled += 1
            self._open[group] = []
            self._open_prompts[group] = prompt
            for _ in range(self.n):
                self._uid += 1
                self._queue.append(_Job(self._uid, group, prompt))

    def _dispatch(self) -> None:
        if not self._queue and self._tail and not self._gen_in_flight():
            self._long_round()  # nothing else to generate: finish the long tail now
        while self._queue:
            free = [
                r for r in range(len(self._chunks)) if self._chunks[r] < self.max_chunks_in_flight
            ]
            if not free:
                return
            rank = min(free, key=lambda r: (self._in_flight[r], r))  # least loaded
            jobs = [self._queue.popleft() for _ in range(min(self.chunk_size, len(self._queue)))]
            requests = [
                Request(
                    j.uid,
                    j.prompt.prompt_ids,
                    hash((self.seed, j.uid, j.calls)) % 2**31,
                    prefix_ids=list(j.response_ids),
                    vision=j.prompt.vision,
                )
                for j in jobs
            ]
            params = SamplingParams(
                max_new_tokens=self.segment,
                temperature=self.params.temperature,
                top_p=self.params.top_p,
                top_k=self.params.top_k,
                stop=self.params.stop,
            )
            if not self._gen_in_flight():
                self._active_since = time.perf_counter()
            future = self.infer.submit(rank, "generate", requests, params)
            self._futures[future] = ("gen", (rank, jobs))
            self._in_flight[rank] += len(jobs)
            self._chunks[rank] += 1

    def _gen_in_flight(self) -> bool:
        return any(self._chunks)

    def _long_round(self) -> None:
        self._c["long_rounds"] += 1
        self._c["long_round_requests"] += len(self._tail)
        self._queue.extendleft(reversed(self._tail))
        self._tail = []

    def _on_generated(self, future: Future, rank: int, jobs: list[_Job]) -> None:
        completions: list[Completion] = _result(future)
        self._in_flight[rank] -= len(jobs)
        self._chunks[rank] -= 1
        if not self._gen_in_flight():
            self._c["gen_active_s"] += time.perf_counter() - self._active_since
        by_id = {c.request_id: c for c in completions}
        lengths: list[int] = [len(c.response_ids) for c in completions]
        longest = max(lengths, default=0)
        if longest:
            self._c["gen_rows"] += len(lengths)
            self._c["gen_row_tokens"] += sum(lengths)
            self._c["gen_row_capacity"] += len(lengths) * longest
        continued: list[_Job] = []
        for job in jobs:
            c = by_id[job.uid]
            room = self.params.max_new_tokens - len(job.response_ids)
            new_ids, new_lp = c.response_ids[:room], c.log_probs[:room]
            job.response_ids += new_ids
            job.log_probs += new_lp
            job.versions.append(c.policy_version)
            job.calls += 1
            job.timing.setdefault("gen_start", c.timing.get("gen_start", time.time()))
            job.timing["gen_end"] = c.timing.get("gen_end", time.time())
            full = len(job.response_ids) >= self.params.max_new_tokens
            if c.finish_reason == "stop" and len(new_ids) == len(c.response_ids):
                self._finish(job, "stop")
            elif full:
                self._finish(job, "length")
            elif self.tail_budget is not None and len(job.response_ids) >= self.tail_budget:
                self._tail.append(job)
                self._c["tail_set_aside"] += 1
            else:
                continued.append(job)
        self._queue.extendleft(reversed(continued))  # unfinished requests go first
        if len(self._tail) >= self.tail_round_size:
            self._long_round()

    def _finish(self, job: _Job, reason: str) -> None:
        sample = Sample(
            uid=job.uid,
            group=job.group,
            prompt=job.prompt,
            response_ids=job.response_ids,
            log_probs=job.log_probs,
            finish_reason=reason,
            policy_version=min(job.versions),
            timing=dict(job.timing),
        )
        sample.timing["max_policy_version"] = float(max(job.versions))
        if len(set(job.versions)) > 1:
            self._c["partial_samples"] += 1
        self._c["samples"] += 1
        self._futures[self.rewards.submit(self._score, sample)] = ("reward", sample)

    def _score(self, sample: Sample) -> Sample:
        sample.timing["reward_start"] = time.time()
        sample.reward, sample.reward_info = self.reward_fn(sample)
        sample.timing["reward_end"] = time.time()
        return sample

    def _on_scored(self, sample: Sample) -> None:
        self._c["reward_s"] += sample.timing["reward_end"] - sample.timing["reward_start"]
        group = self._open[sample.group]
        group.append(sample)
        if len(group) < self.n:
            return
        del self._open[sample.group]
        del self._open_prompts[sample.group]
        rewards = [x.reward for x in group]
        if self.dynamic_sampling and max(rewards) == min(rewards):
            self._c["groups_dropped"] += 1
            self._dropped_since_handout += 1
            return
        self.buffer.put(sorted(group, key=lambda x: x.uid))

    # ---- metrics ----------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        keys = (
            "samples", "groups_dropped", "aborted", "aborted_tokens", "partial_continued",
            "partial_samples", "tail_set_aside", "long_rounds", "long_round_requests",
            "gen_active_s", "reward_s", "gen_rows", "gen_row_tokens", "gen_row_capacity",
        )  # fmt: skip
        self._c: dict[str, float] = dict.fromkeys(keys, 0.0)
        self._since = time.perf_counter()
        self._active_since = self._since

    def _step_metrics(self) -> dict[str, float]:
        """Counters since the previous ``next_batch`` (call under ``self._cond``)."""
        now = time.perf_counter()
        c = dict(self._c)
        if self._gen_in_flight():  # count the running call's share up to now
            c["gen_active_s"] += now - self._active_since
            self._active_since = now
        wall = max(1e-9, now - self._since)
        out = {
            "rollout/samples_generated": c["samples"],
            "rollout/groups_dropped": c["groups_dropped"],
            "rollout/wall_s": wall,
            "rollout/reward_s": c["reward_s"],
            "rollout/gen_active_s": c["gen_active_s"],
            "rollout/gen_idle_fraction": max(0.0, 1.0 - c["gen_active_s"] / wall),
            "rollout/gen_wait_slowest_share": 1.0
            - c["gen_row_tokens"] / max(1.0, c["gen_row_capacity"]),
            "async/aborted_requests": c["aborted"],
            "async/aborted_tokens": c["aborted_tokens"],
            "async/partial_continued": c["partial_continued"],
            "async/partial_samples": c["partial_samples"],
            "async/tail_set_aside": c["tail_set_aside"],
            "async/long_rounds": c["long_rounds"],
        }
        out |= self.buffer.metrics("async/")
        self._reset_counters()
        return out
