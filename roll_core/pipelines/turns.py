"""The driver side of colocated roles taking turns on their devices (rlvr and agentic).

`Turns` runs the phase order of roll_core/engine/colocation.py around a step: after the
rollout `to_train()` (actor_infer offloads, actor_train reloads), after the update
`sync(update)` (actor_train offloads optimizer / grads, actor_infer's weights come back, the
weight sync, actor_train's params leave, actor_infer's KV cache comes back). Each move's time,
bytes and the device memory after it (measured inside the worker processes) are the step's
`time/offload`, `time/reload`, `offload/...`, `reload/...` and `memory/...` metrics
(docs/metrics.md). With nothing to move (disaggregated, or nothing chosen) every call is a
no-op that adds no metric.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from roll_core.engine import Cluster
from roll_core.engine.colocation import OffloadChoice


class Turns:
    """One run's colocated turn-taking (a no-op when nothing is chosen to move)."""

    def __init__(self, choice: OffloadChoice, *, train: Cluster, infer: Cluster) -> None:
        self.choice = choice
        self.train = train
        self.infer = infer
        self.metrics: dict[str, float] = {}
        self.training = False
        """actor_train's turn (its state resident, actor_infer's offloaded)."""

    @property
    def active(self) -> bool:
        return self.choice.active

    # ---- the moves ----------------------------------------------------------------------------
    def _move(self, role: str, verb: str, phase: str, call: Callable[[], list[Any]]) -> None:
        start = time.perf_counter()
        reports = call()
        seconds = time.perf_counter() - start
        m = self.metrics
        m[f"time/{verb}"] = m.get(f"time/{verb}", 0.0) + seconds
        m[f"{verb}/{role}_s"] = m.get(f"{verb}/{role}_s", 0.0) + seconds
        moved = sum(v for r in reports for k, v in r.items() if k.startswith("bytes/"))
        m[f"{verb}/bytes"] = m.get(f"{verb}/bytes", 0.0) + moved
        m[f"{verb}/{role}_bytes"] = m.get(f"{verb}/{role}_bytes", 0.0) + moved
        self._memory(phase, role, reports)

    def _memory(self, phase: str, role: str, reports: list[dict[str, float]]) -> None:
        """`memory/<phase>/<role>_<kind>`: the largest of the role's ranks."""
        for r in reports:
            for k, v in r.items():
                if k.startswith("memory/"):
                    key = f"memory/{phase}/{role}_{k.removeprefix('memory/')}"
                    self.metrics[key] = max(self.metrics.get(key, 0.0), v)

    def _measure(self, phase: str) -> None:
        for role, cluster in (("actor_train", self.train), ("actor_infer", self.infer)):
            reports = [{f"memory/{k}": v for k, v in r.items()} for r in cluster.memory()]
            self._memory(phase, role, reports)

    def start(self) -> None:
        """After the roles are built (both resident): actor_train's chosen parts leave, so
        generation has the room it was planned with."""
        if not self.active:
            return
        parts = list(self.choice.train)
        if parts:
            self._move("actor_train", "offload", "start", lambda: self.train.offload(parts))
        self.metrics = {}

    def to_train(self) -> None:
        """After the rollout: actor_infer frees its memory, actor_train's state comes back."""
        if not self.active or self.training:
            return
        self._measure("after_generate")
        if self.choice.infer_parts:
            parts = list(self.choice.infer_parts)
            self._move(
                "actor_infer",
                "offload",
                "after_infer_offload",
                lambda: self.infer.offload(parts, level=self.choice.sleep_level),
            )
        if self.choice.train:
            self._move("actor_train", "reload", "after_train_reload", self.train.reload)
        self.training = True

    def sync(self, update: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
        """`update` (the weight sync) wrapped in the moves around it (module doc)."""
        if not self.active:
            return update

        def wrapped() -> dict[str, float]:
            return self.to_generate(sync=update) | self.take_metrics()

        return wrapped

    def to_generate(self, sync: Callable[[], dict[str, float]] | None = None) -> dict[str, float]:
        """After the update: actor_train's optimizer / grads leave, actor_infer's weights
        come back, `sync()` (the weight sync) runs, actor_train's params leave, the KV
        cache comes back. Returns `sync()`'s metrics."""
        synced: dict[str, float] = {}
        if not self.training:  # e.g. the first sync after start(): nothing has moved
            return sync() if sync is not None else synced
        self._measure("after_update")
        first = [p for p in self.choice.train if p != "params"]
        if first:
            self._move(
                "actor_train",
                "offload",
                "after_train_offload",
                lambda: self.train.offload(first),
            )
        if self.choice.infer_weights:
            self._move(
                "actor_infer",
                "reload",
                "after_infer_reload",
                lambda: self.infer.reload(["weights"]),
            )
        if sync is not None:
            synced = sync()
        if "params" in self.choice.train:
            self._move(
                "actor_train",
                "offload",
                "after_train_offload",
                lambda: self.train.offload(["params"]),
            )
        rest = [p for p in self.choice.infer_parts if p != "weights"]
        if rest:
            self._move(
                "actor_infer", "reload", "after_infer_reload", lambda: self.infer.reload(rest)
            )
        self.training = False
        return synced

    def take_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    @contextlib.contextmanager
    def train_turn(self) -> Iterator[None]:
        """actor_train resident for the block (checkpoint save / load, export), then back to
        generation's layout; no metric is kept."""
        was = self.training
        self.to_train()
        try:
            yield
        finally:
            if not was:
                self.to_generate()
            self.metrics = {}
