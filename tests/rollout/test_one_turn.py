"""RLVR one-turn groups of the rollout producer on the real hf backend (tiny random model,
local executor)."""

from __future__ import annotations

import pytest

from roll_core.backends.infer import SamplingParams
from roll_core.engine import Cluster, LocalExecutor
from roll_core.models import materialize_builtin
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample, prompt_producer
from roll_core.rollout.producer import RolloutProducer
from roll_core.workers.actor_infer import ActorInfer


@pytest.fixture(scope="module")
def infer(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    path = str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))
    cluster = Cluster(
        "actor_infer",
        ActorInfer,
        LocalExecutor(),
        world_size=2,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": {"model_path": path, "device": "cpu", "num_threads": 1},
        },
    )
    cluster.run("setup")
    return cluster


def prompts(count: int):
    for i in range(count):
        yield Prompt(index=i, prompt_ids=[5 + i % 7, 9, 11, 12 + i % 3], row={"answer": str(i)})


def parity_reward(sample: Sample) -> tuple[float, dict]:
    # even prompts: reward varies with the sample; odd prompts: constant (zero variance)
    if sample.prompt.index % 2:
        return 1.0, {}
    return float(sample.uid % 2), {}


def make(infer: Cluster, **kw) -> RolloutProducer:
    args = dict(
        infer=infer,
        prompts=prompts(1000),
        reward_fn=parity_reward,
        params=SamplingParams(max_new_tokens=6, temperature=1.0),
        n=4,
        prompts_per_step=6,
        deterministic=True,  # streaming over hf: tests/pipelines (end to end)
        chunk_size=4,
        max_chunks_in_flight=1,
        seed=0,
    )
    args.update(kw)
    return prompt_producer(**args)


def test_rewards_start_while_generation_still_runs(infer: Cluster) -> None:
    sched = make(infer)
    out = sched.next_batch(step=1)
    sched.close()
    samples = [s for g in out.groups for s in g]
    assert len(out.groups) == 6 and all(len(g) == 4 for g in out.groups)
    last_gen_end = max(s.timing["gen_end"] for s in samples)
    first_reward = min(s.timing["reward_start"] for s in samples)
    assert first_reward < last_gen_end  # queue scheduling: no barrier before rewards
    assert out.metrics["rollout/rewards_before_last_gen"] > 0
    assert {s.policy_version for s in samples} == {0}
    assert len({s.uid for s in samples}) == 24


def test_dynamic_sampling_fills_the_batch(infer: Cluster) -> None:
    sched = make(infer, dynamic_sampling=True, max_additional_prompts=20)
    out = sched.next_batch(step=1)
    sched.close()
    # every odd prompt's group has zero reward variance and is replaced by another prompt
    assert len(out.groups) == 6
    assert all(g[0].prompt.index % 2 == 0 for g in out.groups)
    assert out.metrics["rollout/groups_dropped"] >= 3
    assert out.metrics["rollout/additional_prompts"] >= 3


def test_dynamic_sampling_budget_is_bounded(infer: Cluster) -> None:
    sched = make(infer, dynamic_sampling=True, max_additional_prompts=1)
    out = sched.next_batch(step=1)
    sched.close()
    assert out.metrics["rollout/additional_prompts"] == 1
    assert len(out.groups) < 6


def test_a_prompt_stream_that_runs_out_ends_the_step_with_what_it_has(infer: Cluster) -> None:
    sched = make(infer, prompts=prompts(4))  # 4 prompts for a step of 6
    try:
        first = sched.next_batch(step=1)
        second = sched.next_batch(step=2)
    finally:
        sched.close()
    assert [g[0].prompt.index for g in first.groups] == [0, 1, 2, 3]
    assert second.groups == []


def test_same_requests_same_responses(infer: Cluster) -> None:
    a = make(infer).next_batch(step=3)
    b = make(infer).next_batch(step=3)
    ra = [s.response_ids for g in a.groups for s in g]
    rb = [s.response_ids for g in b.groups for s in g]
    assert ra == rb


def test_batch_layout_is_token_in_token_out(infer: Cluster) -> None:
    out = make(infer, prompts_per_step=2).next_batch(step=1)
    batch = build_rl_batch(out.groups, pad_id=0)
    s = out.groups[0][0]
    p, r = len(s.prompt.prompt_ids), len(s.response_ids)
    assert batch.tensors["input_ids"][0, : p + r].tolist() == s.prompt.prompt_ids + s.response_ids
    mask = batch.tensors["response_mask"][0]
    assert mask.sum() == r and mask[p - 1] == 1 and (r == 0 or mask[p - 2] == 0)
    assert batch.tensors["behaviour_log_probs"][0, p - 1 : p - 1 + r].tolist() == pytest.approx(
        s.log_probs
    )


def test_deterministic_chunks_span_prompts(infer: Cluster) -> None:
    # 6 prompts x 4 samples = 24 requests, in chunks of chunk_size across prompts (pull
    # order): one generate call for the step with chunk_size 24, three with chunk_size 8
    # (one call per prompt would be 6 in both)
    one = make(infer, chunk_size=24).next_batch(step=1)
    three = make(infer, chunk_size=8).next_batch(step=1)
    assert one.metrics["rollout/gen_calls"] == 1
    assert three.metrics["rollout/gen_calls"] == 3
    assert len(one.groups) == len(three.groups) == 6
    assert all(len(g) == 4 for g in one.groups + three.groups)
