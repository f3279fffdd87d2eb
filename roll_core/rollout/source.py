"""Where the RL loop's training batches come from: one protocol over the one producer.

`pipelines/rl_loop.py` runs rlvr and agentic as one loop over a :class:`RolloutSource`
(docs/internals.md "The loop"): `next_batch(step)` gives the step's scored, filtered, fresh
enough groups, `to_batch(groups)` their exactly generated token ids and masks, and
``with source.paused(step) as metrics:`` suspends generation while the caller updates the
weights, then resumes it at policy version `step`.

:class:`ProducerSource` is the one implementation: the rollout producer
(rollout/producer.py) does the work for both pipelines; what differs is only how groups
become a training Batch (:class:`RLVRSource`: one row per sample; :class:`AgenticSource`: one
row per episode or per turn) and where a checkpoint keeps the producer's state.

Checkpoints: a source's ``state_dict()`` / ``load_state_dict()`` is what a resume needs
(the prompts of groups an async RLVR run held back, the agentic group seeds). The RLVR source
keeps the on-disk layout of earlier runs, a file ``async_rollout.pt`` written only when groups
are held back, through ``save_checkpoint(dir)`` / ``load_checkpoint(dir)``, which the
DriverLoop (pipelines/common.py) prefers when a registered part has them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from roll_core.data import Batch
from roll_core.errors import DataError
from roll_core.rollout.agentic import episode_metrics, step_batch, trajectory_batch
from roll_core.rollout.agentic.batch import DROPPED_NO_GENERATED, DROPPED_TOO_LONG
from roll_core.rollout.agentic.episodes import EpisodeMembers
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.producer import Rollout, RolloutProducer
from roll_core.rollout.router import Router

ASYNC_STATE_FILE = "async_rollout.pt"
"""An RLVR checkpoint's held-back groups (absent when none were held)."""

__all__ = ["AgenticSource", "ProducerSource", "RLVRSource", "Rollout", "RolloutSource"]


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


class ProducerSource:
    """The rollout producer as the loop's source: at ratio 0 each step's groups are produced
    on the call and nothing generates between steps; at ratio >= 1 it generates while the
    step trains, and a weight sync suspends it and resumes it at the new version."""

    def __init__(
        self, producer: RolloutProducer, *, step_metrics: Callable[[], dict[str, float]] = dict
    ) -> None:
        self.producer = producer
        self._step_metrics = step_metrics

    @property
    def router(self) -> Router:
        """The router every generation request of the run goes through (validation too)."""
        return self.producer.router

    def next_batch(self, step: int) -> Rollout:
        return self.producer.next_batch(step)

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        raise NotImplementedError

    def _check_some(self, groups: list[list[Any]]) -> None:
        """A step whose every group dynamic sampling dropped has nothing to train on."""
        if not groups:
            raise DataError(
                "rollout produced no groups (every group was dropped by dynamic sampling).",
                hint=f"Raise rollout.max_additional_{self.producer.members.unit} or turn "
                "algorithm.dynamic_sampling off.",
            )

    def hold(self) -> None:
        if self.producer.started:
            self.producer.suspend()

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[dict[str, float]]:
        """The producer's pause around the block (the weight sync; its timings in the yielded
        dict). Before the first batch nothing generates: the first sync pauses nothing."""
        if not self.producer.started:
            yield {}
            return
        with self.producer.paused(version) as out:
            yield out

    def metrics(self) -> dict[str, float]:
        return self._step_metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.producer.load_state_dict(state)

    def close(self) -> None:
        self.producer.close()


class RLVRSource(ProducerSource):
    """RLVR: one row per scored sample (rollout/batch.py); the held-back prompts of an async
    run in ``async_rollout.pt``."""

    def __init__(
        self,
        producer: RolloutProducer,
        *,
        pad_id: int,
        step_metrics: Callable[[], dict[str, float]] = dict,
    ) -> None:
        super().__init__(producer, step_metrics=step_metrics)
        self.pad_id = pad_id

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        self._check_some(groups)
        return build_rl_batch(groups, pad_id=self.pad_id)

    def save_checkpoint(self, ckpt: Path) -> None:
        """``async_rollout.pt`` in `ckpt` when groups are held back (async only)."""
        held = self.state_dict()
        if held:
            torch.save(held, ckpt / ASYNC_STATE_FILE)

    def load_checkpoint(self, ckpt: Path) -> None:
        saved = ckpt / ASYNC_STATE_FILE
        if saved.exists():
            self.load_state_dict(torch.load(saved))


class AgenticSource(ProducerSource):
    """Agentic: `mode` trajectory (one row per episode, StarPO) or step (one row per turn,
    GiGPO, returns discounted by `gamma`); the first episode faults of each env are shown
    through `note`."""

    def __init__(
        self,
        producer: RolloutProducer,
        *,
        pad_id: int,
        mode: str,
        max_context: int,
        gamma: float = 1.0,
        note: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(producer)
        self.pad_id = pad_id
        self.mode = mode
        self.max_context = max_context
        self.gamma = gamma
        self.note = note  # shows the first faults' text on the run's console
        self._dropped: dict[str, float] = {}

    @property
    def members(self) -> EpisodeMembers:
        return self.producer.members  # type: ignore[return-value]

    def next_batch(self, step: int) -> Rollout:
        try:
            result = self.producer.next_batch(step)
        finally:
            self.show_faults()
        trajs = [t for g in result.groups for t in g]
        return Rollout(
            result.groups, {**result.metrics, **episode_metrics(trajs, prefix="rollout")}
        )

    def show_faults(self) -> None:
        """The text of the episode faults not shown yet (the first few of each env)."""
        for text in self.members.take_fault_notes():
            if self.note is not None:
                self.note(text)

    def to_batch(self, groups: list[list[Any]]) -> Batch:
        """The step's rows; rows that must not be trained (no generated token, longer than
        rollout.max_context) are left out and counted in ``rollout/rows_dropped_*``."""
        self._check_some(groups)
        max_len = self.max_context
        if self.mode == "step":
            batch = step_batch(groups, pad_id=self.pad_id, gamma=self.gamma, max_len=max_len)
        else:
            batch = trajectory_batch(groups, pad_id=self.pad_id, max_len=max_len)
        for key in (DROPPED_NO_GENERATED, DROPPED_TOO_LONG):
            self._dropped[f"rollout/{key}"] = float(batch.meta.pop(key, 0))
        return batch

    def metrics(self) -> dict[str, float]:
        out, self._dropped = self._dropped, {}
        return out
