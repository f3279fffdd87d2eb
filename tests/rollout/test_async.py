"""Async rollout on the real hf backend (tiny random model, local executor): partial rollout
continues from the exact prefix; suspend -> sync -> resume loses and duplicates no sample;
the trainer only gets samples within the freshness bound; bad recipes fail clearly."""

from __future__ import annotations

import pytest
import torch

from roll_core.backends.infer import Request, SamplingParams
from roll_core.engine import Cluster, LocalExecutor
from roll_core.errors import ConfigError
from roll_core.models import materialize_builtin
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample, prompt_producer
from roll_core.rollout.placement import check_prefix_support, rollout_placement
from roll_core.rollout.producer import RolloutProducer
from roll_core.workers.actor_infer import ActorInfer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def infer(model_path: str) -> Cluster:
    cluster = Cluster(
        "actor_infer",
        ActorInfer,
        LocalExecutor(),
        world_size=1,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": {"model_path": model_path, "device": "cpu", "num_threads": 1},
        },
    )
    cluster.run("setup")
    return cluster


def test_partial_rollout_continues_from_the_exact_prefix(model_path: str) -> None:
    from roll_core.backends.infer.hf import HFInferBackend

    b = HFInferBackend(model_path=model_path, device="cpu", num_threads=1)
    eos = b.tokenizer.eos_token_id
    prompt = [5, 9, 11, 13]
    # sampled: the same seed gives the same first segment; greedy continuation is checkable
    full = b.generate([Request(1, prompt, 7)], SamplingParams(max_new_tokens=10, temperature=0))
    head = b.generate([Request(1, prompt, 7)], SamplingParams(max_new_tokens=4, temperature=0))
    prefix = head[0].response_ids
    assert len(prefix) == 4 and eos not in prefix
    tail = b.generate(
        [Request(1, prompt, 7, prefix_ids=prefix)], SamplingParams(max_new_tokens=6, temperature=0)
    )[0]
    assert prefix + tail.response_ids == full[0].response_ids
    torch.testing.assert_close(
        head[0].log_probs + tail.log_probs, full[0].log_probs, rtol=0, atol=1e-4
    )
    # the backend really consumed the prefix: feeding a different prefix changes the output
    other = b.generate(
        [Request(1, prompt, 7, prefix_ids=[17, 18, 19, 20])],
        SamplingParams(max_new_tokens=6, temperature=0),
    )[0]
    assert other.log_probs != tail.log_probs


def prompts(count: int):
    for i in range(count):
        yield Prompt(index=i, prompt_ids=[5 + i % 7, 9, 11, 12 + i % 3], row={"answer": str(i)})


def reward(sample: Sample) -> tuple[float, dict]:
    return float(sample.uid % 2), {}


def make(infer: Cluster, **kw) -> RolloutProducer:
    args = dict(
        infer=infer,
        prompts=prompts(10_000),
        reward_fn=reward,
        params=SamplingParams(max_new_tokens=12, temperature=1.0),
        n=2,
        prompts_per_step=3,
        async_generation_ratio=1,
        seed=0,
    )
    args.update(kw)
    return prompt_producer(**args)


def drive(infer: Cluster, sched: RolloutProducer, steps: int) -> list[list[list[Sample]]]:
    """The driver loop's shape: take a batch, 'train', suspend -> sync -> resume."""
    weights = {"model.norm.weight": None}
    backend = infer.handles[0].worker.backend
    norm = backend.model.state_dict()["model.norm.weight"]
    batches = []
    try:
        for step in range(steps):
            out = sched.next_batch(step)
            batches.append(out.groups)
            for g in out.groups:
                for s in g:  # the freshness bound, at hand-out time
                    assert s.policy_version >= step - sched.ratio
            weights["model.norm.weight"] = norm * 1.01  # new weights, new version

            def update(v: int = step + 1) -> dict[str, float]:
                infer.run("update_weights", weights, version=v)
                return {}

            sched.sync(update, step + 1)
    finally:
        sched.close()
    return batches


@pytest.mark.parametrize("mode", ["deterministic", "streaming", "partial"])
def test_suspend_sync_resume_loses_and_duplicates_nothing(infer: Cluster, mode: str) -> None:
    infer.run("update_weights", {}, version=0)  # the module's engine carries the last test's label
    if mode == "deterministic":
        sched = make(infer, deterministic=True, chunk_size=4, max_chunks_in_flight=1)
    else:
        sched = make(infer, partial_rollout=mode == "partial")
    batches = drive(infer, sched, steps=4)
    samples = [s for groups in batches for g in groups for s in g]
    uids = [s.uid for s in samples]
    assert len(uids) == len(set(uids)) == 4 * 3 * 2  # no duplicate, every batch full
    for groups in batches:
        assert len(groups) == 3
        for g in groups:  # complete groups of one prompt, n samples each
            assert len(g) == 2 and len({s.prompt.index for s in g}) == 1
    for s in samples:
        assert len(s.response_ids) == len(s.log_probs) <= 12
        assert s.finish_reason in ("stop", "length")
    # a response cut by a sync (partial rollout: aborted, continued from its prefix) has one
    # log-prob and one version per token, oldest first; without it no response spans a sync
    for s in samples:
        if mode != "partial":
            assert s.timing["max_policy_version"] == s.policy_version
        elif s.token_versions:
            assert len(s.token_versions) == len(s.response_ids)
            assert s.token_versions == sorted(s.token_versions)
            assert s.policy_version == s.token_versions[0]
    assert sched.buffers["prompts"].handed_out == 12
    batch = build_rl_batch(batches[-1], pad_id=0)
    assert batch.tensors["policy_versions"].min() >= 3 - 1


def test_bad_async_recipes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="cannot overlap"):
        rollout_placement(ratio=1, executor="local", train_device="cuda", infer_device="cuda")
    with pytest.raises(ConfigError, match="cannot overlap"):
        rollout_placement(
            ratio=2,
            executor="ray",
            train_device="cuda",
            infer_device="cuda",
            train_gpus=[0, 1],
            infer_gpus=[1],
        )
    assert "disaggregated" in rollout_placement(
        ratio=1, executor="ray", train_device="cuda", infer_device="cuda", train_gpus=[0],
        infer_gpus=[1],
    )  # fmt: skip
    assert "sync: colocated" in rollout_placement(
        ratio=0, executor="local", train_device="cuda", infer_device="cuda"
    )
    with pytest.raises(ConfigError, match="cannot continue"):
        check_prefix_support("vllm", False, partial_rollout=True, allow_fallback=False)
    assert check_prefix_support("vllm", False, partial_rollout=True, allow_fallback=True) is False
    assert check_prefix_support("hf", True, partial_rollout=True, allow_fallback=False) is True


def test_staleness_counts_weight_syncs_not_version_labels(infer: Cluster) -> None:
    """The RLVR loop's labels skip one (initial weights 0, after step 1: 2, then 3, ...): the
    first batch is still on-policy (staleness 0) and every batch is at most `ratio` syncs old.
    Counting labels instead would call the first batch 1 version stale and drop the groups of
    the initial weights at step 2 although they are one update old."""
    infer.run("update_weights", {}, version=0)  # the initial weights' label
    sched = make(infer, partial_rollout=True)
    hists = []
    try:
        for step in range(1, 4):  # the driver loop's 1-based steps
            out = sched.next_batch(step)
            hists.append({k: v for k, v in out.metrics.items() if "staleness_hist" in k})
            sched.sync(lambda v=step + 1: infer.run("update_weights", {}, version=v), step + 1)
    finally:
        sched.close()
    # 3 groups, generated by the weights trained at step 1 (cumulative histogram)
    assert hists[0] == {"async/staleness_hist/0": 3.0, "async/staleness_hist/1": 0.0}
    assert sched.buffers["prompts"].current_version == 3  # advanced at each of the three syncs
    assert sched.buffers["prompts"].handed_out == 9
    assert max(int(k.rsplit("/", 1)[1]) for h in hists for k, v in h.items() if v) <= sched.ratio
