"""The env-level async rollout manager: groups, redundancy, failing and hanging envs, async.

These tests use a scripted inference cluster (answers every prompt with a fixed move after a
short, optional delay) so they exercise the threads, routing and bookkeeping in milliseconds;
test_agentic_tito.py runs the real hf backend.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.envs import FrozenLakeEnv, TextEnv, Transition, parse_choice
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout
from roll_core.errors import RollError, WorkerDiedError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.rollout.agentic import (
    EnvSpec,
    RolloutSettings,
    env_producer,
    episode_metrics,
    run_episodes,
    step_batch,
    trajectory_batch,
)
from roll_core.rollout.producer import RolloutProducer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("c"))))


class ScriptedInfer:
    """A stand-in actor_infer cluster: every request is answered with `answer` + eos."""

    def __init__(self, tokenizer: Any, answer: str = "Right", *, delay: float = 0.0) -> None:
        self.world_size = 1
        self.tok = tokenizer
        self.answer = answer
        self.delay = delay
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.version = 0
        self.batches: list[int] = []
        self.aborted: list[int] = []

    # the cluster surface the router uses: infer.at(rank).<method>(...) -> Future
    def at(self, rank: int) -> ScriptedInfer:
        assert rank == 0
        return self

    def generate_request(self, request: Request, params: SamplingParams) -> Future:
        return self.pool.submit(lambda: self._generate([request])[0])

    def generate(self, requests: list[Request], params: SamplingParams) -> Future:
        return self.pool.submit(self._generate, requests)

    def abort_requests(self, request_ids: list[int]) -> Future:
        self.aborted.extend(request_ids)
        done: Future = Future()
        done.set_result(None)
        return done

    def _generate(self, requests: list[Request]) -> list[Completion]:
        time.sleep(self.delay)
        self.batches.append(len(requests))
        ids = self.tok.encode(self.answer, add_special_tokens=False) + [self.tok.eos_token_id]
        return [
            Completion(r.request_id, ids, [-0.5] * len(ids), "stop", self.version) for r in requests
        ]


class Corridor(TextEnv):
    """Walk right `length` cells. Per-seed faults: raise, hang or be slow, for given episodes."""

    name = ""
    instructions = "Go right."
    faults: dict[int, str] = {}  # noqa: RUF012 - set per test
    calls: dict[int, int] = {}  # noqa: RUF012 - resets per seed, to fault only the first ones
    lock = threading.Lock()

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        self.pos = 0
        with self.lock:
            seed = int(rng.integers(1 << 30))
            self.key = seed
            n = self.calls.get(seed, 0)
            self.calls[seed] = n + 1
        self.nth = n  # the how-many-th episode of this seed
        self.fault = self.faults.get(n, "")
        return "at 0", {}

    def parse_action(self, text: str) -> str:
        return parse_choice(text, {"right": "Right", "left": "Left"})

    def on_step(self, action: str) -> Transition:
        if self.fault == "raise":
            raise RuntimeError("env crashed")
        if self.fault == "hang":
            time.sleep(30)
        if self.fault == "slow" or self.fault == f"slow{self.pos}":
            time.sleep(0.3)
        self.pos += 1 if action == "Right" else -1
        done = self.pos >= 3
        return Transition(f"at {self.pos}", 1.0 if done else 0.0, done, {"success": done})

    def render(self) -> str:
        return f"pos {self.pos}"


def settings(**kw: Any) -> RolloutSettings:
    base: dict[str, Any] = dict(
        params=SamplingParams(max_new_tokens=8),
        group_size=2,
        max_context=512,
        step_timeout_s=0.5,
        episode_timeout_s=20,
    )
    base.update(kw)
    return RolloutSettings(**base)


def manager(tok: Any, infer: Any, specs: list[EnvSpec], **kw: Any) -> RolloutProducer:
    return env_producer(infer=infer, tokenizer=tok, specs=specs, settings=settings(**kw))


def corridor_spec(faults: dict[int, str], groups: int = 2) -> EnvSpec:
    class Env(Corridor):
        pass

    Env.faults, Env.calls = faults, {}
    return EnvSpec("corridor", Env, None, groups)


@pytest.mark.parametrize("deterministic", [False, True])
def test_groups_complete_with_the_same_seed_and_token_traces(
    tokenizer: Any, deterministic: bool
) -> None:
    infer = ScriptedInfer(tokenizer, delay=0.002)
    mgr = manager(tokenizer, infer, [corridor_spec({}, groups=3)], deterministic=deterministic)
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    assert len(result.groups) == 3
    for group in result.groups:
        assert len(group) == 2
        assert len({t.seed for t in group}) == 1  # a group shares its seed
        for t in group:
            assert t.status == "done" and t.success and len(t.turns) == 3
            # generated tokens are masked in, and only they: 3 turns x ("Right" + eos)
            assert sum(t.trace.mask) == 3 * 6
            assert len(t.trace.ids) == len(t.trace.mask) == len(t.trace.log_probs)
    assert len({g[0].seed for g in result.groups}) == 3
    assert result.metrics["rollout/env_errors"] == 0
    assert sum(infer.batches) == 3 * 2 * 3  # every turn of every episode: one request
    if deterministic:  # requests of different episodes were batched into shared calls
        assert max(infer.batches) > 1
    else:  # streaming: each turn on its own (the engine batches what is in flight)
        assert max(infer.batches) == 1 and result.metrics["rollout/gen_calls"] == 18


def test_failing_and_hanging_envs_are_counted_and_replaced(tokenizer: Any) -> None:
    # the first episode played on each seed raises, the second hangs; replacements succeed
    spec = corridor_spec({0: "raise", 1: "hang"}, groups=2)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], group_size=1, max_replacements=2)
    try:
        start = time.perf_counter()
        result = mgr.next_batch(1)
        wall = time.perf_counter() - start
        notes = mgr.members.take_fault_notes()
        assert mgr.members.take_fault_notes() == []
    finally:
        mgr.close()
    # the text of the first 3 of the 4 faults, for the run's console
    assert len(notes) == 3
    assert all(n.startswith("training episode of corridor failed (") for n in notes)
    assert any("(error): RuntimeError: env crashed (at " in n for n in notes)
    assert any("(timeout): timeout: env step() did not return" in n for n in notes)
    assert notes[-1].endswith(
        "[the first 3 faults of corridor are shown; the rest are only counted: "
        "rollout/ and eval/ env_errors, env_timeouts]"
    )
    m = result.metrics
    assert len(result.groups) == 2 and all(g[0].status == "done" for g in result.groups)
    assert m["rollout/corridor/env_errors"] == 2
    assert m["rollout/corridor/env_timeouts"] == 2
    assert m["rollout/env_errors"] == 2 and m["rollout/env_timeouts"] == 2
    assert m["rollout/corridor/env_replaced"] == 4
    assert wall < 5  # a hang costs step_timeout_s (0.5 s), not the env's 30 s


def test_too_many_failed_groups_is_an_error(tokenizer: Any) -> None:
    spec = corridor_spec({k: "raise" for k in range(100)}, groups=1)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], group_size=1, max_replacements=1)
    try:
        with pytest.raises(EnvFault, match="env corridor failed too often") as info:
            mgr.next_batch(1)
    finally:
        mgr.close()
    # 1 group needed, 2*1+2 failed groups allowed: the 5th failed group (2 episodes each:
    # the first and its one replacement) stops the step, so at least 10 episodes raised
    err = info.value
    assert isinstance(err, RollError) and err.metrics["rollout/corridor/env_errors"] >= 10
    assert err.metrics["rollout/env_errors"] == err.metrics["rollout/corridor/env_errors"]
    assert "First error: RuntimeError: env crashed (at " in err.message
    assert "test_agentic.py:" in err.message and "in on_step)" in err.message  # where
    assert "rollout.max_replacements" in str(err.hint)


def test_redundant_groups_cut_the_slow_group_and_keep_whole_groups(tokenizer: Any) -> None:
    # 2 groups needed, 1 redundant: 3 groups of 2 launched (training seeds 0, 1, 2). Every
    # episode of seed 0 is slow (0.3 s per step, >= 0.9 s an episode): the two fast groups are
    # taken whole, in launch order, and the slow group is cancelled (2 episodes)
    class SlowSeed0(Corridor):
        def reset(self, seed: int | None = None) -> Any:
            out = super().reset(seed)
            self.fault = "slow" if seed == 0 else ""
            return out

    SlowSeed0.faults, SlowSeed0.calls = {}, {}
    spec = EnvSpec("corridor", SlowSeed0, None, 2)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], group_size=2, redundant_groups=1)
    try:
        start = time.perf_counter()
        result = mgr.next_batch(1)
        wall = time.perf_counter() - start
        time.sleep(0.5)  # let the cancelled episodes notice
        cancelled = mgr.members._counters_metrics().get("rollout/corridor/episodes_cancelled", 0)
    finally:
        mgr.close()
    assert [g[0].seed for g in result.groups] == [1, 2]
    assert all(
        [t.index for t in g] == [0, 1] and all(t.status == "done" for t in g) for g in result.groups
    )
    assert result.metrics["rollout/groups_redundant_cancelled"] == 1
    assert wall < 0.85
    assert cancelled + result.metrics.get("rollout/corridor/episodes_cancelled", 0) == 2


def test_cancelled_episodes_abort_their_request_in_flight(tokenizer: Any) -> None:
    # one group needed, one redundant; requests are served one at a time (0.05 s each), so
    # when the first group completes the other group's episodes have requests in flight:
    # abandoning the group aborts them on the engine instead of letting them run out
    infer = ScriptedInfer(tokenizer, delay=0.05)
    spec = corridor_spec({}, groups=1)
    mgr = manager(tokenizer, infer, [spec], group_size=2, redundant_groups=1)
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    assert result.metrics["rollout/groups_redundant_cancelled"] == 1
    assert infer.aborted  # the abandoned group's waiting turns


def test_redundancy_never_filters_the_episodes_of_a_group(tokenizer: Any) -> None:
    # the first play of every seed is slow: a group's slow episode is kept with its fast one
    # (keeping "the first G episodes to finish" would drop it: a bias to short episodes)
    spec = corridor_spec({0: "slow"}, groups=2)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], group_size=2, redundant_groups=2)
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    assert len(result.groups) == 2
    for group in result.groups:
        assert [t.index for t in group] == [0, 1]
        assert sorted(t.wall_s >= 0.85 for t in group) == [False, True]


def test_turn_barrier_is_the_lockstep_baseline(tokenizer: Any) -> None:
    # one episode is slow at its first step, the other at its second: without a barrier each
    # episode waits 0.3 s once (wall ~0.3 s); in lockstep every turn waits for the slowest
    # episode (wall ~0.6 s)
    walls = {}
    for barrier in (False, True):
        spec = corridor_spec({0: "slow0", 1: "slow1"}, groups=1)
        mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], turn_barrier=barrier)
        try:
            start = time.perf_counter()
            result = mgr.next_batch(1)
            walls[barrier] = time.perf_counter() - start
        finally:
            mgr.close()
        assert all(t.status == "done" for t in result.groups[0])
    assert walls[True] > 0.55
    assert walls[False] < walls[True] - 0.15


def test_env_timeout_helper() -> None:
    assert call_with_timeout(lambda x: x + 1, 1, timeout=1) == 2
    with pytest.raises(EnvTimeout):
        call_with_timeout(time.sleep, 5, timeout=0.05)
    with pytest.raises(ValueError):
        call_with_timeout(int, "x", timeout=1)


def test_step_mode_rows_and_state_keys(tokenizer: Any) -> None:
    spec = EnvSpec("lake", lambda: FrozenLakeEnv(map="SFF/FFF/FFG", max_steps=4), "Go.", 1)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec], mode="step", history_window=1)
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    group = result.groups[0]
    # always Right on SFF/FFF/FFG: 2 moves to the right edge, then stuck, truncated at 4 steps
    assert [t.status for t in group] == ["truncated", "truncated"]
    batch = step_batch(result.groups, pad_id=tokenizer.pad_token_id, gamma=1.0)
    assert len(batch) == 8  # 2 episodes x 4 steps
    for row, turn in enumerate(t for traj in group for t in traj.turns):
        ids = batch.tensors["input_ids"][row].tolist()
        n = len(turn.prompt_ids) + len(turn.response_ids)
        assert ids[:n] == turn.prompt_ids + turn.response_ids
        assert batch.tensors["response_mask"][row].sum() == len(turn.response_ids)
    # both episodes visit the same states in the same order: 4 anchor groups of 2 steps; the
    # last two steps act from the same state (stuck at the edge) but are distinct turns
    anchors = batch.tensors["anchor_ids"].tolist()
    assert anchors[:4] == anchors[4:]
    assert len(set(anchors)) == 3  # start, middle, right edge (twice)
    m = episode_metrics([t for g in result.groups for t in g], prefix="rollout")
    assert m["rollout/success_rate"] == 0 and m["rollout/episode_length"] == 4


def test_trajectory_batch_masks_only_generated_tokens(tokenizer: Any) -> None:
    spec = corridor_spec({}, groups=1)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec])
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    batch = trajectory_batch(result.groups, pad_id=tokenizer.pad_token_id)
    mask = batch.tensors["response_mask"]
    ids = batch.tensors["input_ids"]
    right = tokenizer.encode("Right", add_special_tokens=False) + [tokenizer.eos_token_id]
    for row in range(len(batch)):
        trained = ids[row, 1:][mask[row] > 0].tolist()  # target space: position t -> t+1
        assert trained == right * 3
        assert batch.tensors["behaviour_log_probs"][row][mask[row] > 0].tolist() == [-0.5] * 18
    assert batch.tensors["scores"].tolist() == [1.0, 1.0]


def test_async_ratio_keeps_generating_and_drops_stale_groups(tokenizer: Any) -> None:
    infer = ScriptedInfer(tokenizer, delay=0.01)
    spec = corridor_spec({}, groups=2)
    mgr = manager(tokenizer, infer, [spec], async_generation_ratio=1)
    try:
        first = mgr.next_batch(1)
        assert first.metrics["rollout/staleness_max"] == 0
        time.sleep(0.3)  # "training": groups keep being generated meanwhile
        with mgr.cond:
            ahead = len(mgr.completed) + len(mgr.active) + len(mgr.buffers[spec.tag])
        assert ahead >= 2  # ratio 1: one step's worth of groups ahead
        # three weight syncs while those groups waited: they are now 3 versions old > ratio 1
        for version in (1, 2, 3):
            mgr.suspend()
            infer.version = version
            mgr.resume(version)
        later = mgr.next_batch(4)
    finally:
        mgr.close()
    assert later.metrics["rollout/groups_dropped_stale"] >= 2
    assert all(t.min_version >= 2 for g in later.groups for t in g)


def test_validation_episodes_are_not_counted_as_training(tokenizer: Any) -> None:
    spec = corridor_spec({}, groups=1)
    mgr = manager(tokenizer, ScriptedInfer(tokenizer), [spec])
    try:
        trajs = run_episodes(mgr, spec, [100, 101, 102], SamplingParams(max_new_tokens=8))
        assert [t.seed for t in trajs] == [100, 101, 102]
        assert all(t.success for t in trajs)
        assert "rollout/corridor/episodes_completed" not in mgr.members._counters_metrics()
    finally:
        mgr.close()


def test_an_episode_on_a_dead_rank_is_replaced_on_a_live_one(tokenizer: Any) -> None:
    class TwoRanks(ScriptedInfer):
        """Rank 1 dies at its first request; rank 0 serves everything."""

        def __init__(self, tok: Any) -> None:
            super().__init__(tok)
            self.world_size = 2

        def at(self, rank: int) -> Any:
            infer = self

            class Rank:
                def generate_request(self, request: Request, params: Any) -> Future:
                    if rank == 0:
                        return infer.generate_request(request, params)
                    dead: Future = Future()
                    dead.set_exception(WorkerDiedError("actor_infer", 1, "killed by the test"))
                    return dead

                def abort_requests(self, ids: list[int]) -> Future:
                    return infer.abort_requests(ids)

            return Rank()

    mgr = manager(tokenizer, TwoRanks(tokenizer), [corridor_spec({}, groups=2)])
    try:
        result = mgr.next_batch(1)
    finally:
        mgr.close()
    assert len(result.groups) == 2
    assert all(t.status == "done" for g in result.groups for t in g)
    assert result.metrics["rollout/corridor/rank_lost"] == 1  # the one request rank 1 got
    assert result.metrics["rollout/corridor/env_replaced"] == 1
    assert mgr.router.live_ranks() == [0]


def test_generation_failure_is_fatal(tokenizer: Any) -> None:
    class Broken(ScriptedInfer):
        def generate_request(self, request: Request, params: Any) -> Future:
            future: Future = Future()
            future.set_exception(RollError("model exploded"))
            return future

    mgr = manager(tokenizer, Broken(tokenizer), [corridor_spec({})])
    try:
        with pytest.raises(RollError, match="model exploded"):
            mgr.next_batch(1)
    finally:
        mgr.close()


def test_an_envs_own_episode_metrics_are_averaged_over_the_episodes_that_have_them() -> None:
    from roll_core.rollout.agentic.episode import Trajectory, env_numbers

    assert env_numbers({"episode_metrics": {"steps": 3, "solved": True, "note": "x"}}) == {
        "steps": 3.0,
        "solved": 1.0,
    }
    assert env_numbers({"success": True}) == {} and env_numbers(None) == {}
    a, b, c = (Trajectory("swe", 0, s, 0) for s in range(3))
    a.env_metrics, b.env_metrics = {"steps": 3.0, "solved": 1.0}, {"steps": 6.0, "solved": 0.0}
    m = episode_metrics([a, b, c], prefix="rollout")  # c (an env without them) is left out
    assert m["rollout/env/steps"] == 4.5 and m["rollout/env/solved"] == 0.5


class Mixed(Corridor):
    """Corridor whose first episode of each seed earns 1.0 and the others 0.5: every group of
    two has reward variance."""

    def on_step(self, action: str) -> Transition:
        out = super().on_step(action)
        if out.terminated:
            return Transition(out.observation, 1.0 if self.nth == 0 else 0.5, True, out.info)
        return out


def test_dynamic_sampling_drops_flat_groups_and_replaces_them_within_the_budget(
    tokenizer: Any,
) -> None:
    # every Corridor episode walks right and earns 1.0: each group of 2 is flat (no signal).
    # ratio 0, 2 groups a step, 2 replacements: 4 groups are run and dropped, none is trained
    spec = corridor_spec({}, groups=2)
    mgr = env_producer(
        infer=ScriptedInfer(tokenizer),
        tokenizer=tokenizer,
        specs=[spec],
        settings=settings(),
        dynamic_sampling=True,
        max_additional_groups=2,
    )
    try:
        out = mgr.next_batch(1)
    finally:
        mgr.close()
    assert out.groups == []
    assert out.metrics["rollout/groups_dropped"] == 4
    assert out.metrics["rollout/additional_groups"] == 2
    assert out.metrics["rollout/groups_kept"] == 0


def test_dynamic_sampling_keeps_groups_with_signal(tokenizer: Any) -> None:
    class Env(Mixed):
        calls: dict[int, int] = {}  # noqa: RUF012

    spec = EnvSpec("mixed", Env, None, 2)
    mgr = env_producer(
        infer=ScriptedInfer(tokenizer),
        tokenizer=tokenizer,
        specs=[spec],
        settings=settings(),
        dynamic_sampling=True,
    )
    try:
        out = mgr.next_batch(1)
    finally:
        mgr.close()
    assert len(out.groups) == 2 and out.metrics["rollout/groups_dropped"] == 0
    assert all(sorted(t.episode_return for t in g) == [0.5, 1.0] for g in out.groups)


def test_async_dynamic_sampling_that_drops_everything_is_an_error(tokenizer: Any) -> None:
    spec = corridor_spec({}, groups=1)
    mgr = env_producer(
        infer=ScriptedInfer(tokenizer),
        tokenizer=tokenizer,
        specs=[spec],
        settings=settings(async_generation_ratio=1),
        dynamic_sampling=True,
        max_additional_groups=1,
    )
    try:
        with pytest.raises(RollError, match="max_additional_groups"):
            mgr.next_batch(1)
    finally:
        mgr.close()
