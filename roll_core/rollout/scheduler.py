"""The sample-level RLVR rollout scheduler.

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
  pulled (at most `max_additional_prompts` per step) until `prompts_per_step` groups are kept.
* Every sample records the policy version of the weights that generated it.
* This is the synchronous scheduler (``rollout.async_generation_ratio = 0``); the async one,
  which keeps generating while the trainer trains, is ``rollout/async_scheduler.py``.

The scheduler does not know Ray: it talks to a Cluster of ActorInfer workers through the
router's futures, which both executors provide.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.prompts import Prompt
from roll_core.errors import RollError
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
    """Wall-clock stamps (gen_start/end, reward_start/end); async rollouts also record
    ``max_policy_version`` here (``policy_version`` is then the oldest version)."""
    token_versions: list[int] = field(default_factory=list)
    """Async rollouts: the policy version of every response token (partial rollout continues a
    response across weight syncs, so they can differ); empty when not recorded."""
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


class RolloutScheduler:
    """Produces `prompts_per_step` groups of `n` scored samples per call."""

    def __init__(
        self,
        *,
        infer: Any,
        prompts: Iterator[Prompt],
        reward_fn: RewardFn,
        params: SamplingParams,
        n: int,
        prompts_per_step: int,
        deterministic: bool = False,
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        group_affinity: bool = False,
        request_timeout_s: float = 1800.0,
        dynamic_sampling: bool = False,
        max_additional_prompts: int = 0,
        reward_workers: int = 4,
        seed: int = 0,
    ) -> None:
        """``chunk_size`` / ``max_chunks_in_flight``: deterministic mode only."""
        self.infer = infer
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.params = params
        self.n = n
        self.prompts_per_step = prompts_per_step
        self.deterministic = deterministic
        self.chunk_size = chunk_size
        self.group_affinity = group_affinity
        self.dynamic_sampling = dynamic_sampling
        self.max_additional_prompts = max_additional_prompts
        self.seed = seed
        self.router = Router(
            infer,
            deterministic=deterministic,
            chunk_size=chunk_size,
            max_chunks_in_flight=max_chunks_in_flight,
            request_timeout_s=request_timeout_s,
        )
        self.rewards = ThreadPoolExecutor(max_workers=reward_workers, thread_name_prefix="reward")
        self._uid = 0

    def close(self) -> None:
        self.router.close()
        self.rewards.shutdown(wait=True, cancel_futures=True)

    def next_batch(self, step: int) -> RolloutResult:
        """Generate and score one step's groups (blocks until they are complete)."""
        run = _StepRun(self, step)
        return run.execute()

    # The same surface as AsyncRolloutScheduler, so a driver loop needs no branch on which one
    # it has. Between steps nothing is generating and no group is held back.
    def sync(self, update: Callable[[], dict[str, float]], version: int) -> dict[str, float]:
        """Run the weight sync ``update()`` (nothing to suspend); returns its metrics."""
        return update()

    def suspend(self) -> None:
        """Nothing to do: between steps nothing is generating."""

    def resume(self, version: int) -> None:
        """Nothing to do (see :meth:`suspend`)."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: every group of a step is trained on in that step (the prompt position is
        the prompt stream's state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], prompts: list[Prompt]) -> None:
        """Nothing to restore (see :meth:`state_dict`)."""


class _StepRun:
    """The state of one `next_batch` call."""

    def __init__(self, sched: RolloutScheduler, step: int) -> None:
        self.s = sched
        self.step = step
        self.pending_rewards = 0
        self.groups: dict[int, list[Sample]] = {}
        self.kept: list[tuple[int, list[Sample]]] = []
        self.futures: dict[Future, tuple[str, Any]] = {}
        # Finished futures in completion order: one queue put per future, where waiting on
        # every pending future after each completion cost O(pending) each (~10-40 ms a step
        # for 128 samples on a loaded 2-core CPU).
        self.done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self.pulled = 0
        self.extra = 0
        self.dropped = 0
        self.samples = 0
        self.reward_s = 0.0
        self.reward_starts: list[float] = []
        self.gen_ends: list[float] = []
        self.router0 = dict(sched.router.stats)

    # ---- prompts and requests -------------------------------------------------------------
    def _pull_prompts(self, count: int) -> int:
        """Pull up to `count` prompts and send their n requests each; the number pulled.
        Deterministic: the requests of all of them, in pull order, in chunks of chunk_size
        (so one step's prompts share generate calls: 16 prompts x 8 samples with chunk_size
        128 is one call); streaming: each request on its own."""
        pulled: list[tuple[Request, Prompt, int]] = []
        for _ in range(count):
            try:
                prompt = next(self.s.prompts)
            except StopIteration:
                break
            group = self.pulled
            self.pulled += 1
            self.groups[group] = []
            for k in range(self.s.n):
                self.s._uid += 1
                seed = hash((self.s.seed, self.step, group, k)) % 2**31
                request = Request(self.s._uid, prompt.prompt_ids, seed, vision=prompt.vision)
                pulled.append((request, prompt, group))
        router, params = self.s.router, self.s.params
        requests = [r for r, _, _ in pulled]
        if self.s.deterministic:
            size = self.s.chunk_size
            futures = []
            for i in range(0, len(requests), size):
                futures += router.submit_batch(requests[i : i + size], params)
        else:
            futures = [
                router.submit(r, params, session=(self.step, g) if self.s.group_affinity else None)
                for r, _, g in pulled
            ]
        submitted = time.time()
        for (request, prompt, group), future in zip(pulled, futures, strict=True):
            self._track(future, ("gen", (request, prompt, group, submitted)))
        return len({g for _, _, g in pulled})

    def _track(self, future: Future, tag: tuple[str, Any]) -> None:
        self.futures[future] = tag
        future.add_done_callback(self.done.put)

    # ---- completions --------------------------------------------------------------------------
    def _on_generated(
        self, future: Future, request: Request, prompt: Prompt, group: int, submitted: float
    ) -> None:
        c: Completion = _result(future)
        self.gen_ends.append(c.timing.get("gen_end", time.time()))
        sample = Sample(
            uid=request.request_id,
            group=group,
            prompt=prompt,
            response_ids=c.response_ids,
            log_probs=c.log_probs,
            finish_reason=c.finish_reason,
            policy_version=c.policy_version,
            timing={"gen_start": submitted, **c.timing},
            routed_experts=c.routed_experts,
        )
        self.samples += 1
        self.pending_rewards += 1
        self._track(self.s.rewards.submit(self._score, sample), ("reward", sample))

    def _score(self, sample: Sample) -> Sample:
        sample.timing["reward_start"] = time.time()
        sample.reward, sample.reward_info = self.s.reward_fn(sample)
        sample.timing["reward_end"] = time.time()
        return sample

    def _on_scored(self, sample: Sample) -> None:
        self.pending_rewards -= 1
        self.reward_starts.append(sample.timing["reward_start"])
        self.reward_s += sample.timing["reward_end"] - sample.timing["reward_start"]
        group = self.groups[sample.group]
        group.append(sample)
        if len(group) < self.s.n:
            return
        if self.s.group_affinity:
            self.s.router.release((self.step, sample.group))
        rewards = [x.reward for x in group]
        if self.s.dynamic_sampling and max(rewards) == min(rewards):
            self.dropped += 1
            if self.extra < self.s.max_additional_prompts and self._pull_prompts(1):
                self.extra += 1
            return
        self.kept.append((sample.group, sorted(group, key=lambda x: x.uid)))

    # ---- the loop -------------------------------------------------------------------------------
    def execute(self) -> RolloutResult:
        start = time.time()
        self._pull_prompts(self.s.prompts_per_step)
        while self.futures:
            future = self.done.get()
            kind, payload = self.futures.pop(future)
            if kind == "gen":
                self._on_generated(future, *payload)
            else:
                self._on_scored(_result(future))
        # Keep groups in prompt order (not completion order) so a step is reproducible.
        kept = [g for _, g in sorted(self.kept, key=lambda kg: kg[0])][: self.s.prompts_per_step]
        return RolloutResult(groups=kept, metrics=self._metrics(kept, time.time() - start))

    def _metrics(self, kept: list[list[Sample]], wall: float) -> dict[str, float]:
        overlap = sum(1 for t in self.reward_starts if self.gen_ends and t < max(self.gen_ends))
        stats = self.s.router.stats
        return {
            "rollout/groups_kept": float(len(kept)),
            "rollout/groups_dropped": float(self.dropped),
            "rollout/additional_prompts": float(self.extra),
            "rollout/samples_generated": float(self.samples),
            "rollout/wall_s": wall,
            "rollout/reward_s": self.reward_s,
            "rollout/rewards_before_last_gen": float(overlap),
            "rollout/gen_active_s": stats["active_s"] - self.router0["active_s"],
            "rollout/gen_calls": stats["calls"] - self.router0["calls"],
        }
