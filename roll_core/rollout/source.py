"""Where the RL loop's training batches come from: one protocol, two producers.

`pipelines/rl_loop.py` runs rlvr and agentic as one loop over a :class:`RolloutSource`
(docs/internals.md "The loop"): `next_batch(step)` gives the step's scored, filtered, fresh
enough groups, `to_batch(groups)` their exactly generated token ids and masks, and
``with source.paused(step) as metrics:`` suspends generation while the caller updates the
weights, then resumes it at policy version `step`.

The adapters here are thin: the producers themselves are the RLVR scheduler
(rollout/scheduler.py, synchronous at ratio 0 and asynchronous above) and the agentic env
manager (rollout/agentic/manager.py), whose interfaces differ; this module is the one place
that knows how.

Checkpoints: a source's ``state_dict()`` / ``load_state_dict()`` is what a resume needs
(the groups an async producer held back, the agentic group seeds). The RLVR source keeps
the on-disk layout of earlier runs, a file ``async_rollout.pt`` written only when groups are
held back, through ``save_checkpoint(dir)`` / ``load_checkpoint(dir)``, which the DriverLoop
(pipelines/common.py) prefers when a registered part has them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from roll_core.data import Batch
from roll_core.errors import DataError
from roll_core.rollout.agentic import (
    EnvRolloutManager,
    episode_metrics,
    step_batch,
    trajectory_batch,
)
from roll_core.rollout.agentic.batch import DROPPED_NO_GENERATED, DROPPED_TOO_LONG
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.router import Router
from roll_core.rollout.scheduler import Prompt, RolloutScheduler

ASYNC_STATE_FILE = "async_rollout.pt"
"""An RLVR checkpoint's held-back groups (absent when none were held)."""


@dataclass
class Rollout:
    """One step's groups (samples of one prompt, or episodes of one env seed) and the
    producer's metrics for them (`rollout/...`, `async/...`)."""

    groups: list[list[Any]]
    metrics: dict[str, float]


class RolloutSource(Protocol):
    """What the RL loop needs of a producer of training groups."""

    def next_batch(self, step: int) -> Rollout:
        """The groups step `step` trains on (blocks until they are ready)."""
        ...

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        """The training Batch of `groups` (rollout/batch.py layout, target space)."""
        ...

    def hold(self) -> None:
        """Stop generating until the next resume: the inference engine is about to give
        its memory to training (colocated roles)."""
        ...

    def paused(self, version: int) -> contextlib.AbstractContextManager[dict[str, float]]:
        """``with source.paused(v) as metrics:`` generation is suspended for the block (the
        caller updates the inference weights), then resumes at policy version `v`; `metrics`
        holds the pause's timings after the block."""
        ...

    def metrics(self) -> dict[str, float]:
        """Metrics of the step that are not tied to its groups (e.g. the reward stage's)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class RLVRSource:
    """The RLVR rollout scheduler (rollout/scheduler.py): at ratio 0 each step's groups are
    generated, scored and filtered on the call and nothing generates between steps; at ratio
    >= 1 it generates while the step trains, and a weight sync suspends it and resumes it at
    the new version."""

    def __init__(
        self,
        scheduler: RolloutScheduler,
        *,
        prompts: list[Prompt],
        pad_id: int,
        step_metrics: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.scheduler = scheduler
        self.prompts = prompts  # the training prompts by index (restoring held groups)
        self.pad_id = pad_id
        self._step_metrics = step_metrics
        self._started = False

    @property
    def router(self) -> Router:
        """The router every generation request of the run goes through (validation too)."""
        return self.scheduler.router

    def next_batch(self, step: int) -> Rollout:
        self._started = True  # the producer thread runs from the first call on
        result = self.scheduler.next_batch(step)
        return Rollout(result.groups, result.metrics)

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        if not groups:
            raise DataError(
                "rollout produced no groups (every group was dropped by dynamic sampling).",
                hint="Raise rollout.max_additional_prompts or turn algorithm.dynamic_sampling off.",
            )
        return build_rl_batch(groups, pad_id=self.pad_id)

    def hold(self) -> None:
        if self._started:
            self.scheduler.suspend()

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[dict[str, float]]:
        """suspend -> the block (the weight sync) -> resume at `version`; async (ratio >= 1)
        also reports `async/suspend_s` (waiting for the calls in flight) and
        `async/sync_pause_s` (the whole pause). Before the first batch the producer has not
        started: the first sync pauses nothing."""
        out: dict[str, float] = {}
        if not self._started:
            yield out
            return
        start = time.perf_counter()
        self.scheduler.suspend()
        suspended = time.perf_counter()
        try:
            yield out
        finally:
            self.scheduler.resume(version)
        if self.scheduler.ratio:
            out["async/suspend_s"] = suspended - start
            out["async/sync_pause_s"] = time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return self._step_metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state, self.prompts)

    def save_checkpoint(self, ckpt: Path) -> None:
        """``async_rollout.pt`` in `ckpt` when groups are held back (async only)."""
        held = self.state_dict()
        if held:
            torch.save(held, ckpt / ASYNC_STATE_FILE)

    def load_checkpoint(self, ckpt: Path) -> None:
        saved = ckpt / ASYNC_STATE_FILE
        if saved.exists():
            self.load_state_dict(torch.load(saved))

    def close(self) -> None:
        self.scheduler.close()


class AgenticSource:
    """The agentic env manager: env groups played on threads (asynchronously with
    `rollout.async_generation_ratio > 0`); `mode` trajectory (one row per episode, StarPO)
    or step (one row per turn, GiGPO, returns discounted by `gamma`)."""

    def __init__(
        self,
        manager: EnvRolloutManager,
        *,
        pad_id: int,
        mode: str,
        gamma: float = 1.0,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.manager = manager
        self.pad_id = pad_id
        self.mode = mode
        self.gamma = gamma
        self.note = note  # shows the first faults' text on the run's console
        self._dropped: dict[str, float] = {}

    def next_batch(self, step: int) -> Rollout:
        try:
            result = self.manager.next_batch(step)
        finally:
            self.show_faults()
        trajs = [t for g in result.groups for t in g]
        return Rollout(
            result.groups, {**result.metrics, **episode_metrics(trajs, prefix="rollout")}
        )

    def show_faults(self) -> None:
        """The text of the episode faults not shown yet (the first few of each env)."""
        for text in self.manager.take_fault_notes():
            if self.note is not None:
                self.note(text)

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        """The step's rows; rows that must not be trained (no generated token, longer than
        rollout.max_context) are left out and counted in ``rollout/rows_dropped_*``."""
        max_len = self.manager.s.max_context
        if self.mode == "step":
            batch = step_batch(groups, pad_id=self.pad_id, gamma=self.gamma, max_len=max_len)
        else:
            batch = trajectory_batch(groups, pad_id=self.pad_id, max_len=max_len)
        for key in (DROPPED_NO_GENERATED, DROPPED_TOO_LONG):
            self._dropped[f"rollout/{key}"] = float(batch.meta.pop(key, 0))
        return batch

    def hold(self) -> None:
        self.manager.suspend()  # no episode generates while the engine is offloaded

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[dict[str, float]]:
        """suspend -> the block -> resume at `version`; `sync/suspended_s` (the whole pause)."""
        out: dict[str, float] = {}
        start = time.perf_counter()
        self.manager.suspend()
        yield out
        self.manager.resume(version)
        out["sync/suspended_s"] = time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out, self._dropped = self._dropped, {}
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    def close(self) -> None:
        self.manager.close()
