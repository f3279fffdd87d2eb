"""The sample-level RLVR rollout scheduler.

* Prompt replication: every prompt becomes `n` independent requests (one per sample).
* Requests go out in chunks of `chunk_size` to the least-loaded inference rank (fewest
  requests in flight); a rank never holds more than `max_chunks_in_flight` chunks.
* Queue scheduling: as soon as a chunk's responses come back their rewards start on a thread
  pool while the ranks keep generating; a group is complete when its n samples are scored.
* Dynamic sampling: a group whose rewards have zero variance is dropped and another prompt is
  pulled (at most `max_additional_prompts` per step) until `prompts_per_step` groups are kept.
* Every sample records the policy version of the weights that generated it.
* This is the synchronous scheduler (``rollout.async_generation_ratio = 0``); the async one,
  which keeps generating while the trainer trains, is ``rollout/async_scheduler.py``.

The scheduler does not know Ray: it talks to a Cluster of ActorInfer workers through
`cluster.submit(rank, ...)` futures, which both executors provide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.data.vision import VisionInputs
from roll_core.errors import RollError


@dataclass
class Prompt:
    """One dataset row ready for generation."""

    index: int
    prompt_ids: list[int]
    row: dict[str, Any]
    vision: VisionInputs | None = None
    """The row's images (vision-language models), made once when the data is loaded."""


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
    """Wall-clock stamps (gen_start/end, reward_start/end); async partial rollouts also record
    ``max_policy_version`` here (``policy_version`` is then the oldest version)."""


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
        chunk_size: int = 16,
        max_chunks_in_flight: int = 2,
        dynamic_sampling: bool = False,
        max_additional_prompts: int = 0,
        reward_workers: int = 4,
        seed: int = 0,
    ) -> None:
        self.infer = infer
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.params = params
        self.n = n
        self.prompts_per_step = prompts_per_step
        self.chunk_size = chunk_size
        self.max_chunks_in_flight = max_chunks_in_flight
        self.dynamic_sampling = dynamic_sampling
        self.max_additional_prompts = max_additional_prompts
        self.seed = seed
        self.rewards = ThreadPoolExecutor(max_workers=reward_workers, thread_name_prefix="reward")
        self._uid = 0

    def close(self) -> None:
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
        self.queue: list[tuple[Request, Prompt, int]] = []
        self.pending_rewards = 0
        self.groups: dict[int, list[Sample]] = {}
        self.kept: list[tuple[int, list[Sample]]] = []
        self.in_flight = [0] * sched.infer.world_size  # requests per rank
        self.chunks = [0] * sched.infer.world_size
        self.futures: dict[Future, tuple[str, Any]] = {}
        self.pulled = 0
        self.extra = 0
        self.dropped = 0
        self.samples = 0
        self.gen_busy_s = 0.0
        self.wait_slowest_s = 0.0
        self.reward_s = 0.0
        self.reward_starts: list[float] = []
        self.gen_ends: list[float] = []
        self.gen_active_s = 0.0  # time with at least one generation call in flight
        self.active_since = 0.0

    # ---- prompts and requests -------------------------------------------------------------
    def _pull_prompt(self) -> bool:
        try:
            prompt = next(self.s.prompts)
        except StopIteration:
            return False
        group = self.pulled
        self.pulled += 1
        self.groups[group] = []
        for k in range(self.s.n):
            self.s._uid += 1
            seed = hash((self.s.seed, self.step, group, k)) % 2**31
            self.queue.append(
                (Request(self.s._uid, prompt.prompt_ids, seed, vision=prompt.vision), prompt, group)
            )
        return True

    def _dispatch(self) -> None:
        while self.queue:
            free = [
                r
                for r in range(len(self.in_flight))
                if self.chunks[r] < self.s.max_chunks_in_flight
            ]
            if not free:
                return
            rank = min(free, key=lambda r: (self.in_flight[r], r))  # least loaded
            chunk, self.queue = self.queue[: self.s.chunk_size], self.queue[self.s.chunk_size :]
            requests = [c[0] for c in chunk]
            if not any(self.chunks):
                self.active_since = time.perf_counter()
            future = self.s.infer.submit(rank, "generate", requests, self.s.params)
            self.futures[future] = ("gen", (rank, chunk, time.time()))
            self.in_flight[rank] += len(chunk)
            self.chunks[rank] += 1

    # ---- completions --------------------------------------------------------------------------
    def _on_generated(self, future: Future, rank: int, chunk: list, submitted: float) -> None:
        completions: list[Completion] = _result(future)
        self.in_flight[rank] -= len(chunk)
        self.chunks[rank] -= 1
        if not any(self.chunks):
            self.gen_active_s += time.perf_counter() - self.active_since
        by_id = {c.request_id: c for c in completions}
        ends = [c.timing.get("gen_end", time.time()) for c in completions]
        self.gen_ends.extend(ends)
        if completions:
            busy = max(ends) - min(c.timing.get("gen_start", submitted) for c in completions)
            lengths = [len(c.response_ids) for c in completions]
            self.gen_busy_s += busy
            # a batched call runs until its longest response ends: the rest of the rows wait
            if max(lengths):
                self.wait_slowest_s += busy * (1 - sum(lengths) / (len(lengths) * max(lengths)))
        for request, prompt, group in chunk:
            c = by_id[request.request_id]
            sample = Sample(
                uid=request.request_id,
                group=group,
                prompt=prompt,
                response_ids=c.response_ids,
                log_probs=c.log_probs,
                finish_reason=c.finish_reason,
                policy_version=c.policy_version,
                timing=dict(c.timing),
            )
            self.samples += 1
            self.pending_rewards += 1
            self.futures[self.s.rewards.submit(self._score, sample)] = ("reward", sample)

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
        rewards = [x.reward for x in group]
        if self.s.dynamic_sampling and max(rewards) == min(rewards):
            self.dropped += 1
            if self.extra < self.s.max_additional_prompts and self._pull_prompt():
                self.extra += 1
            return
        self.kept.append((sample.group, sorted(group, key=lambda x: x.uid)))

    # ---- the loop -------------------------------------------------------------------------------
    def execute(self) -> RolloutResult:
        start = time.time()
        for _ in range(self.s.prompts_per_step):
            if not self._pull_prompt():
                break
        self._dispatch()
        while self.futures:
            done, _ = wait(list(self.futures), return_when=FIRST_COMPLETED)
            for future in done:
                kind, payload = self.futures.pop(future)
                if kind == "gen":
                    self._on_generated(future, *payload)
                else:
                    self._on_scored(_result(future))
            self._dispatch()
        # Keep groups in prompt order (not completion order) so a step is reproducible.
        kept = [g for _, g in sorted(self.kept, key=lambda kg: kg[0])][: self.s.prompts_per_step]
        return RolloutResult(groups=kept, metrics=self._metrics(kept, time.time() - start))

    def _metrics(self, kept: list[list[Sample]], wall: float) -> dict[str, float]:
        overlap = sum(1 for t in self.reward_starts if self.gen_ends and t < max(self.gen_ends))
        return {
            "rollout/groups_kept": float(len(kept)),
            "rollout/groups_dropped": float(self.dropped),
            "rollout/additional_prompts": float(self.extra),
            "rollout/samples_generated": float(self.samples),
            "rollout/wall_s": wall,
            "rollout/reward_s": self.reward_s,
            "rollout/rewards_before_last_gen": float(overlap),
            "rollout/gen_wait_slowest_share": self.wait_slowest_s / max(1e-9, self.gen_busy_s),
            "rollout/gen_active_s": self.gen_active_s,
        }
