"""The one rollout producer of the RL pipelines: groups in, fresh enough groups out.

A *group* is what group-relative advantages compare: the ``n`` samples of one RLVR prompt (a
one-turn episode group, :mod:`roll_core.rollout.one_turn`) or the G episodes of one env seed
(:mod:`roll_core.rollout.agentic.episodes`). What a group's members are and how they run is
the job of a :class:`Members` object; everything about *which* groups run, *when*, and *which*
are handed to the trainer is here, once for both pipelines:

* **Tags.** Every group has a tag (an env's name; rlvr has one tag) and each tag has its
  groups per step. Each tag's complete groups wait in their own
  :class:`~roll_core.rollout.buffer.FreshnessBuffer`.
* **Admission** (as AReaL's). With ``async_generation_ratio`` k, a tag may have
  ``(k + 1) * per_step + redundant`` groups that the trainer has not taken (running, complete
  or buffered) while the trainer waits for a batch, and ``k * per_step + redundant`` from the
  moment that batch is taken until the next weight sync. **k = 0 is the synchronous
  pipeline**: groups are admitted only while the trainer waits in :meth:`next_batch`, and
  nothing runs between steps.
* **Hand-out.** A step takes ``per_step`` groups of each tag, the first to complete, in launch
  order within the batch (reproducible with deterministic generation). With ratio 0 the
  groups a step did not need (``redundant`` ones still running or complete beyond need) are
  abandoned: they would be stale at the next step.
* **Staleness**, counted in weight syncs (not in the labels the loop gives versions): the
  weights the producer starts with are update ``start_version``, and each :meth:`resume` is one
  more. A group is as old as its oldest member's weights; a buffer hands out only groups at
  most k updates older than the ones being trained and drops (and counts) the rest.
* **Dynamic sampling** (``dynamic_sampling``): a complete group whose rewards have zero
  variance is dropped. Ratio 0: another group takes its place, at most ``max_additional`` a
  step per tag (then the step has fewer groups). Async: a replacement is admitted as usual;
  more than ``per_step + max_additional`` drops in a row before a batch fills is an error.
* **Faults.** A group its members could not complete (an env that kept failing) is dropped
  and replaced; more than ``2 * per_step + 2`` such groups of one tag in one step stop the run
  with the error :meth:`Members.fault_stop` writes.
* **Weight sync**: :meth:`suspend` (the router holds new requests and waits for the ones in
  flight; :attr:`Members.abort_on_suspend` aborts them instead, partial rollout) -> the
  update -> :meth:`resume` at the new version.
* **Validation** (:meth:`run_groups`): uncounted groups on the same machinery, never handed
  to the trainer, never in the rollout metrics.
* **Checkpoints**: :meth:`state_dict` is the members' state given the groups not yet handed
  out (an async RLVR run regenerates their prompts first after a resume).

Threads: group work runs on the members' threads, which report a finished group with
:meth:`group_ended` (under :attr:`cond`, the one lock of the producer and its members). The
trainer's thread does admission, absorbs finished groups and hands them out; nothing else
admits, so a step's admission order is the trainer's.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from roll_core.errors import DataError, RollError
from roll_core.rollout.buffer import FreshnessBuffer
from roll_core.rollout.router import Router

M = TypeVar("M")
"""A group member: a scored sample (one turn) or a trajectory (an episode)."""


@dataclass(eq=False)
class Group(Generic[M]):
    """One group: ``size`` members on the same ``key`` (a prompt, an env seed)."""

    gid: int
    tag: str
    key: Any
    size: int
    counted: bool = True
    """A training group (feeds admission, the buffers and the rollout metrics); validation
    groups are not counted."""
    step: int = 0
    """The step the trainer waited for when the group was admitted (ratio 0 seeds)."""
    index: int = 0
    """Its position among that step's admissions (ratio 0 seeds)."""
    options: Any = None
    """The members' own per-group settings (validation's sampling params, an env spec)."""
    kept: list[M] = field(default_factory=list)
    """The members that count, in the order they completed."""
    ended: list[M] = field(default_factory=list)
    """Every member that ended (kept, failed or cancelled), in the order they ended."""
    finished: bool = False
    failed: bool = False
    """Finished without reaching its size (its members could not be completed)."""
    abandoned: bool = False
    """A group the trainer will never take (ratio 0, beyond a step's need): never handed out."""


class Members(abc.ABC, Generic[M]):
    """The pipeline-specific part of rollout: what a group's members are and how they run.

    The producer calls every method below with :attr:`RolloutProducer.cond` held, except
    :meth:`close`; a member thread that touches a group takes that lock and reports a group
    that finished (complete or failed) with :meth:`RolloutProducer.group_ended`."""

    router: Router
    producer: RolloutProducer[M]
    abort_on_suspend: bool = False
    """Suspend aborts the requests in flight (each keeps its partial response and continues
    after the sync: partial rollout) instead of waiting for them."""
    unit: str = "groups"
    """What the metrics call one group (``rollout/additional_<unit>``)."""

    def attach(self, producer: RolloutProducer[M]) -> None:
        self.producer = producer

    @abc.abstractmethod
    def next_key(self, tag: str) -> Any | None:
        """The key of the next training group of ``tag``; None when there is none (the prompt
        stream is exhausted)."""

    @abc.abstractmethod
    def launch(self, groups: list[Group[M]]) -> None:
        """Start every member of ``groups`` (admitted together: one call for the groups one
        admission opens, so a deterministic engine sees the same chunks)."""

    @abc.abstractmethod
    def cancel(self, group: Group[M]) -> None:
        """Stop the group's running members (it was abandoned)."""

    @abc.abstractmethod
    def version(self, group: Group[M]) -> int:
        """The version label of the oldest weights that produced any member of ``group``."""

    @abc.abstractmethod
    def rewards(self, group: Group[M]) -> list[float]:
        """The rewards dynamic sampling compares (one per kept member)."""

    def ordered(self, group: Group[M]) -> list[M]:
        """The group's members in batch order."""
        return list(group.kept)

    def step_metrics(self, groups: list[Group[M]]) -> dict[str, float]:
        """The members' metrics of a step (their counters since the last call, then reset)."""
        return {}

    def begin_step(self) -> None:
        """The trainer waits for a batch: a ratio-0 step's rollout starts now."""

    def fault_stop(self, tag: str, failed_groups: int) -> RollError:
        """The error that stops the run when ``tag`` failed more groups than a step allows."""
        return RollError(f"rollout of {tag} failed {failed_groups} groups in one step")

    def state_dict(self, pending: list[Group[M]]) -> dict[str, Any]:
        """What a resume needs; ``pending``: the training groups not yet handed out, oldest
        first."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before the first batch."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every member (without :attr:`RolloutProducer.cond` held)."""


@dataclass
class Rollout(Generic[M]):
    """One step's groups (each a list of members, in batch order) and the producer's metrics
    for them (``rollout/...``, ``async/...``)."""

    groups: list[list[M]]
    metrics: dict[str, float]


class RolloutProducer(Generic[M]):
    """Produces the trainer's groups (see the module docstring)."""

    def __init__(
        self,
        members: Members[M],
        *,
        per_step: dict[str, int],
        size: int,
        async_generation_ratio: int = 0,
        redundant: int = 0,
        dynamic_sampling: bool = False,
        max_additional: int = 0,
        start_version: int = 0,
    ) -> None:
        if async_generation_ratio < 0:
            raise ValueError("async_generation_ratio must be >= 0")
        self.members = members
        self.router = members.router
        self.per_step = dict(per_step)
        self.size = size
        self.ratio = async_generation_ratio
        self.redundant = redundant
        self.dynamic_sampling = dynamic_sampling
        self.max_additional = max_additional
        self.cond = threading.Condition()
        self.buffers: dict[str, FreshnessBuffer[Group[M]]] = {
            tag: FreshnessBuffer(
                self.ratio, version_of=self._group_updates, current_version=start_version
            )
            for tag in per_step
        }
        self._start_updates = start_version
        self._updates = start_version  # weight syncs so far (the version being trained)
        self._update_of: dict[int, int] = {}  # version label -> its update count
        self._gid = 0
        self.active: list[Group[M]] = []  # launched, not finished
        self.completed: list[Group[M]] = []  # finished, not yet absorbed by the trainer
        self.fatal: BaseException | None = None
        self._suspended = False
        self._waiting = False  # the trainer is in next_batch (ratio 0 admits only then)
        self._taken = False  # the batch of the current version was handed out
        self._want: dict[str, int] = {}  # groups per tag the waiting step wants
        self._taken_now: dict[str, int] = {}  # ... and has taken so far
        self._extra: dict[str, int] = {}  # ... and the replacements granted (ratio 0)
        self._step = 0
        self._step_index = 0
        self._dropped_in_row = dict.fromkeys(per_step, 0)
        self._stale_seen = 0
        self._started = False
        self._closed = False
        self._reset_counters()
        members.attach(self)

    # ---- the trainer's side -----------------------------------------------------------------
    @property
    def started(self) -> bool:
        """A batch was asked for (before that, nothing generates)."""
        return self._started

    def start(self) -> None:
        """Start generating ahead of the first batch (async; ratio 0 admits nothing before
        :meth:`next_batch`)."""
        with self.cond:
            self._started = True
            self._top_up()

    def next_batch(self, step: int) -> Rollout[M]:
        """Every tag's ``per_step`` groups, fresh enough (blocks until they are ready).
        Ratio 0: fewer when dynamic sampling dropped more than it could replace."""
        with self.cond:
            self._started = True
            if self.ratio == 0:
                self._reset_counters()  # the step's rollout starts now
                self.members.begin_step()
            self._step, self._step_index = step, 0
            self._want = dict(self.per_step)
            self._taken_now = dict.fromkeys(self.per_step, 0)
            self._extra = dict.fromkeys(self.per_step, 0)
            self._waiting = True
            taken: dict[str, list[Group[M]]] = {tag: [] for tag in self.per_step}
            try:
                self._fill(taken)
            finally:
                self._waiting = False
            self._taken = True
            self._dropped_in_row = dict.fromkeys(self.per_step, 0)
            abandoned = self._abandon_unneeded() if self.ratio == 0 else 0
            groups = [g for tag in self.per_step for g in sorted(taken[tag], key=_gid)]
            metrics = self._step_metrics(groups, abandoned)
            self._top_up()  # async: keep generating (ratio 0: admits nothing)
            return Rollout([self.members.ordered(g) for g in groups], metrics)

    def _fill(self, taken: dict[str, list[Group[M]]]) -> None:
        """(lock held) Admit, absorb finished groups and take them until every tag has what
        the step wants."""
        budget = {tag: 2 * n + 2 for tag, n in self.per_step.items()}
        for buffer in self.buffers.values():
            buffer.advance(self._updates)
        self._take_ready(taken)  # groups an earlier step left (async), oldest first
        self._top_up()
        while any(len(taken[t]) < self._want[t] for t in self.per_step):
            if not self.completed and not any(g.counted and not g.abandoned for g in self.active):
                return  # nothing left to wait for: the keys ran out (fewer groups)
            while not self.completed and self.fatal is None:
                self.cond.wait(0.25)
            if self.fatal is not None:
                raise self.fatal
            done, self.completed = self.completed, []
            for group in sorted(done, key=_gid):  # launch order among the finished
                self._absorb(group, budget)
            self._take_ready(taken)  # what is beyond need stays for a later step
            self._top_up()

    def _absorb(self, group: Group[M], budget: dict[str, int]) -> None:
        """(lock held) A finished training group: failed (budget), dropped by dynamic
        sampling, or into its tag's buffer (where a stale one is dropped and counted)."""
        tag = group.tag
        if group.failed:
            self._c["failed"] += 1
            budget[tag] -= 1
            if budget[tag] < 0:
                raise self.members.fault_stop(tag, int(self._c["failed"]))
            return
        rewards = self.members.rewards(group)
        if self.dynamic_sampling and max(rewards) == min(rewards):
            self._c["dropped"] += 1
            self._dropped_in_row[tag] += 1
            if self.ratio > 0:
                if self._dropped_in_row[tag] > self.per_step[tag] + self.max_additional:
                    raise DataError(
                        "async rollout: dynamic sampling dropped every group "
                        f"({self._dropped_in_row[tag]} in a row) before a batch was full.",
                        hint=f"Raise rollout.max_additional_{self.members.unit} or turn "
                        "algorithm.dynamic_sampling off.",
                    )
            elif self._extra[tag] < self.max_additional:
                self._extra[tag] += 1
                self._c["additional"] += 1
                self._top_up()  # its replacement is requested at once, as its own launch
            else:
                self._want[tag] -= 1
            return
        self.buffers[tag].put(group)

    def _take_ready(self, taken: dict[str, list[Group[M]]]) -> None:
        """(lock held) Move the oldest buffered groups of each tag into ``taken``."""
        for tag, buffer in self.buffers.items():
            n = min(len(buffer), self._want[tag] - len(taken[tag]))
            if n > 0:
                taken[tag].extend(buffer.get(n))
                self._taken_now[tag] += n

    def _top_up(self) -> None:
        """(lock held) Admit groups up to the limit of every tag (module docstring)."""
        if self._suspended or self._closed or (self.ratio == 0 and not self._waiting):
            return
        opened: list[Group[M]] = []
        for tag, per_step in self.per_step.items():
            if self._waiting:
                limit = self.ratio * per_step + self.redundant + self._want[tag]
                limit -= self._taken_now[tag]
            else:
                limit = (self.ratio + 1 - self._taken) * per_step + self.redundant
            for _ in range(max(0, limit - self._have(tag))):
                key = self.members.next_key(tag)
                if key is None:
                    break
                opened.append(self._open(tag, key))
        if opened:
            self.members.launch(opened)

    def _have(self, tag: str) -> int:
        """(lock held) Training groups of ``tag`` the trainer has not taken and that may still
        be handed out."""
        live = sum(
            1
            for g in self.active + self.completed
            if g.tag == tag and g.counted and not g.failed and not g.abandoned
        )
        return live + len(self.buffers[tag])

    def _open(self, tag: str, key: Any) -> Group[M]:
        group: Group[M] = Group(
            self._gid, tag, key, self.size, step=self._step, index=self._step_index
        )
        self._gid += 1
        self._step_index += 1
        self.active.append(group)
        return group

    def group_ended(self, group: Group[M]) -> None:
        """(lock held; called by the members) ``group`` finished: complete, or failed."""
        group.finished = True
        if group in self.active:
            self.active.remove(group)
        if group.counted and not group.abandoned:
            self.completed.append(group)
        self.cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """A member thread hit an error that ends the run: raised to the trainer."""
        with self.cond:
            if self.fatal is None:
                self.fatal = err
            self.cond.notify_all()

    def _abandon_unneeded(self) -> int:
        """(lock held) After a ratio-0 step's batch: cancel the training groups still
        running, drop the finished ones beyond need; return how many."""
        running = [g for g in self.active if g.counted and not g.abandoned]
        for group in running:
            group.abandoned = True
            self.members.cancel(group)
        finished = [g for g in self.completed if g.counted]
        self.completed = [g for g in self.completed if not g.counted]
        waiting = sum(len(buffer.take_all()) for buffer in self.buffers.values())
        return len(running) + len(finished) + waiting

    # ---- validation -------------------------------------------------------------------------
    def run_groups(self, tag: str, keys: Iterable[Any], size: int, options: Any) -> list[Group]:
        """Uncounted groups of ``size`` on ``keys`` (validation), run to their end beside the
        training ones; never handed out. ``options``: the members' per-group settings."""
        with self.cond:
            groups: list[Group[M]] = []
            for key in keys:
                groups.append(Group(self._gid, tag, key, size, counted=False, options=options))
                self._gid += 1
            self.active += groups
            self.members.launch(groups)
            while not all(g.finished for g in groups) and self.fatal is None:
                self.cond.wait(0.25)
            if self.fatal is not None:
                raise self.fatal
        return groups

    # ---- weight sync ------------------------------------------------------------------------
    def suspend(self) -> None:
        """Before a weight sync (or while a colocated engine gives its memory to training):
        hold new requests and return once none is in flight."""
        with self.cond:
            self._suspended = True
        self.router.pause(abort=self.members.abort_on_suspend)

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[dict[str, float]]:
        """:meth:`suspend` -> the block (the weight sync) -> :meth:`resume` at ``version``, also
        when the block raises. The yielded dict gets ``sync/suspended_s`` (the whole pause)
        and, async, ``async/suspend_s`` (waiting for the calls in flight) and
        ``async/sync_pause_s``."""
        out: dict[str, float] = {}
        start = time.perf_counter()
        self.suspend()
        suspended = time.perf_counter()
        try:
            yield out
        finally:
            self.resume(version)
        out["sync/suspended_s"] = time.perf_counter() - start
        if self.ratio:
            out["async/suspend_s"] = suspended - start
            out["async/sync_pause_s"] = out["sync/suspended_s"]

    def sync(self, update: Any, version: int) -> dict[str, float]:
        """``update()`` (the weight sync) inside :meth:`paused`: its metrics and the pause's."""
        with self.paused(version) as pause:
            result = update()
        return {**(dict(result) if isinstance(result, dict) else {}), **pause}

    def resume(self, version: int) -> None:
        """Generate with the weights of ``version`` (one more weight sync) from now on."""
        with self.cond:
            self._updates += 1
            self._update_of[version] = self._updates  # before any call with these weights
            self._suspended = False
            self._taken = False
            for buffer in self.buffers.values():
                buffer.advance(self._updates)  # too old for the next step: dropped, counted
            self._top_up()
        self.router.resume()

    def _group_updates(self, group: Group[M]) -> int:
        """The update count of the group's oldest weights (labels never synced here: the
        weights the producer started with)."""
        return self._update_of.get(self.members.version(group), self._start_updates)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            pending = [g for b in self.buffers.values() for g in b.snapshot()]
            live = [
                g
                for g in self.active + self.completed
                if g.counted and not g.failed and not g.abandoned
            ]
            return self.members.state_dict(pending + sorted(live, key=_gid))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.cond:
            self.members.load_state_dict(state)

    def close(self) -> None:
        with self.cond:
            self._closed = True
            for buffer in self.buffers.values():
                buffer.close()
            self.cond.notify_all()
        self.members.close()

    # ---- metrics ----------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self._c: dict[str, float] = dict.fromkeys(("failed", "dropped", "additional"), 0.0)
        self._since = time.perf_counter()
        self._router0 = (self.router.active_seconds(), self.router.stats["calls"])

    def _step_metrics(self, groups: list[Group[M]], abandoned: int) -> dict[str, float]:
        """(lock held) The producer's counters since the previous hand-out (ratio 0: since
        this step's began), then the members'."""
        now = time.perf_counter()
        stale_total = sum(b.dropped_stale for b in self.buffers.values())
        stale, self._stale_seen = stale_total - self._stale_seen, stale_total
        ages = [self._updates - self._group_updates(g) for g in groups]
        out = {
            "rollout/groups_kept": float(len(groups)),
            "rollout/groups_dropped": self._c["dropped"],
            "rollout/groups_dropped_failed": self._c["failed"],
            "rollout/groups_dropped_stale": float(stale),
            "rollout/groups_redundant_cancelled": float(abandoned),
            f"rollout/additional_{self.members.unit}": self._c["additional"],
            "rollout/wall_s": max(1e-9, now - self._since),
            "rollout/gen_calls": self.router.stats["calls"] - self._router0[1],
            "rollout/staleness_max": float(max(ages, default=0)),
            "rollout/staleness_mean": sum(ages) / max(1, len(ages)),
        }
        active = self.router.active_seconds() - self._router0[0]
        out["rollout/gen_active_s"] = active
        out["rollout/gen_idle_fraction"] = max(0.0, 1.0 - active / out["rollout/wall_s"])
        if self.ratio > 0:
            for tag, buffer in self.buffers.items():
                out |= buffer.metrics("async/" if len(self.buffers) == 1 else f"async/{tag}/")
        out |= self.members.step_metrics(groups)
        self._reset_counters()
        return out


def _gid(group: Group[Any]) -> int:
    return group.gid
