"""The RLVR scheduler over the router, on fake request-level engines
(tests/rollout/fake_engine.py): per-request scoring, group affinity, deterministic chunks, and
partial rollout by abort (the continued response is the partial one plus new tokens, every token
with the version that generated it)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from roll_core.backends.infer import SamplingParams
from roll_core.engine import Cluster, LocalExecutor
from roll_core.errors import WorkerDiedError
from roll_core.rollout.one_turn import Prompt, Sample, prompt_producer
from roll_core.rollout.producer import RolloutProducer
from roll_core.rollout.router import GenerationTimeout
from tests.rollout.fake_engine import FakeEngine, token


def engines(world: int = 2, **kw: Any) -> Cluster:
    return Cluster("actor_infer", FakeEngine, LocalExecutor(), world_size=world, worker_kwargs=kw)


def prompts(count: int):
    for i in range(count):
        yield Prompt(index=i, prompt_ids=[5 + i % 7, 9, 11], row={})


def parity(sample: Sample) -> tuple[float, dict]:
    return (1.0, {}) if sample.prompt.index % 2 else (float(sample.uid % 2), {})


def make(infer: Cluster, **kw: Any) -> RolloutProducer:
    args: dict[str, Any] = dict(
        infer=infer,
        prompts=prompts(100),
        reward_fn=parity,
        params=SamplingParams(max_new_tokens=24),
        n=4,
        prompts_per_step=4,
    )
    return prompt_producer(**(args | kw))


def test_streaming_scores_each_response_as_it_finishes() -> None:
    infer = engines(2, token_s=0.004)
    sched = make(infer, dynamic_sampling=True, max_additional_prompts=8)
    out = sched.next_batch(step=1)
    sched.close()
    assert len(out.groups) == 4 and all(len(g) == 4 for g in out.groups)
    assert all(g[0].prompt.index % 2 == 0 for g in out.groups)  # odd groups: zero variance
    samples = [s for g in out.groups for s in g]
    # lengths 1..24 tokens (by seed): short responses are scored while long ones still run
    assert out.metrics["rollout/rewards_before_last_gen"] > 0
    assert out.metrics["rollout/gen_calls"] == out.metrics["rollout/samples_generated"]
    for s in samples:  # the fake's tokens: exactly what the engine generated for that request
        assert s.response_ids == [
            token(s.response_ids[0] - 100, i) for i in range(len(s.response_ids))
        ]
    served = infer.served_ids()
    assert sum(len(r) for r in served) == out.metrics["rollout/samples_generated"]
    assert all(served)  # both ranks were used


def test_group_affinity_keeps_a_group_on_one_rank() -> None:
    infer = engines(2, token_s=0.002)
    sched = make(infer, group_affinity=True)
    out = sched.next_batch(step=1)
    sched.close()
    rank_of = {rid: r for r, ids in enumerate(infer.served_ids()) for rid in ids}
    for g in out.groups:
        assert len({rank_of[s.uid] for s in g}) == 1
    assert sched.router.sessions == {}  # released when each group completed


def test_deterministic_mode_sends_fixed_chunks_in_pull_order() -> None:
    infer = engines(2, token_s=0.001)
    sched = make(infer, deterministic=True, chunk_size=4, max_chunks_in_flight=1)
    out = sched.next_batch(step=1)
    sched.close()
    batches = sorted(b for r in infer.batch_ids() for b in r)
    assert batches == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    assert [s.uid for g in out.groups for s in g] == list(range(1, 17))
    assert out.metrics["rollout/gen_calls"] == 4


def test_ratio_zero_generates_only_inside_next_batch_with_step_seeds() -> None:
    """Ratio 0 is the synchronous scheduler: a step's requests are seeded by (seed, step,
    group of the step, sample), its groups come back in prompt order, and nothing is pulled or
    generated between calls (so nothing is held for a checkpoint)."""
    infer = engines(2, token_s=0.001)
    stream = prompts(100)
    sched = make(infer, prompts=stream, seed=5)
    for step in (1, 2):
        out = sched.next_batch(step=step)
        assert [g[0].prompt.index for g in out.groups] == [4 * (step - 1) + i for i in range(4)]
        for g, group in enumerate(out.groups):
            for k, sample in enumerate(group):
                seed = hash((5, step, g, k)) % 2**31
                assert sample.response_ids == [token(seed, i) for i in range(1 + seed % 24)]
        calls = sched.router.stats["calls"]
        time.sleep(0.3)  # the producer thread runs, but admits nothing between steps
        assert sched.router.stats["calls"] == calls and sched.state_dict() == {}
    assert next(stream).index == 8  # no prompt was pulled ahead
    assert "rollout/additional_prompts" in out.metrics
    assert not any(k.startswith("async/") for k in out.metrics)
    sched.close()
    with pytest.raises(ValueError, match="async streaming mode only"):
        make(infer, partial_rollout=True)


def test_partial_rollout_aborts_at_the_sync_and_continues_under_the_new_weights() -> None:
    length = 150
    infer = engines(1, token_s=0.01, lengths={uid: length for uid in range(1, 50)})
    sched = prompt_producer(
        infer=infer,
        prompts=prompts(100),
        reward_fn=lambda s: (float(s.uid % 2), {}),
        params=SamplingParams(max_new_tokens=length),
        n=2,
        prompts_per_step=1,
        async_generation_ratio=1,
        partial_rollout=True,
        seed=3,
    )
    sched.start()
    time.sleep(0.2)  # ~20 tokens of each response under version 0
    metrics = sched.sync(lambda: infer.set_version(1) or {"sync/s": 0.0}, version=1)
    assert metrics["async/suspend_s"] < 1.0  # aborted, not waited for (150 tokens = 1.5 s)
    out = sched.next_batch(step=1)
    sched.close()
    for s in (s for g in out.groups for s in g):
        k = s.token_versions.count(0)
        assert 0 < k < length and s.token_versions == [0] * k + [1] * (length - k)
        first, second = (hash((3, s.uid, call)) % 2**31 for call in (0, 1))
        assert s.response_ids[:k] == [token(first, i) for i in range(k)]  # the partial
        assert s.response_ids[k:] == [token(second, i) for i in range(k, length)]  # continued
        assert s.log_probs == [-(i + 1) / 100 for i in range(length)]
        assert s.policy_version == 0 and s.timing["max_policy_version"] == 1.0
        assert s.finish_reason == "length"
    assert out.metrics["async/aborted_requests"] >= 2
    assert out.metrics["async/partial_continued"] >= 2
    assert out.metrics["async/partial_samples"] >= 2


def test_a_dead_rank_or_a_stuck_request_fails_the_step_naming_the_rank() -> None:
    # rank 0 dies at request 1: the step fails with the named death instead of waiting
    sched = make(engines(2, token_s=0.002, die=(1,)))
    with pytest.raises(WorkerDiedError, match="actor_infer rank 0 died"):
        sched.next_batch(step=1)
    sched.close()
    # request 2 never finishes on rank 1: the step fails after request_timeout_s
    sched = make(engines(2, token_s=0.002, hang=(2,)), request_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(GenerationTimeout, match="rank 1 did not answer"):
        sched.next_batch(step=1)
    assert time.monotonic() - start < 5
    sched.close()
