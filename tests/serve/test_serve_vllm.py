"""`roll serve` with ``sample.engine: vllm`` (the real CLI, the real `tinker` client): one vLLM
engine for the served model directory, each sampling session a LoRA adapter that vLLM loads
per request. Sampled and prompt log-probs equal a forward of the trained model; a session made
from the live model and one from its saved checkpoint sample the same tokens; base-model
sessions sample the base weights; greedy and stop tokens behave as on the hf engine; a closed
session's adapter files go with it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.serve.test_serve_rl import VLLM
from tests.serve.test_serve_tinker import (
    ADAM,
    SFT,
    Server,
    _datum,
    _logprobs,
    check_stop_tokens_and_greedy,
)

tinker = pytest.importorskip(
    "tinker", reason="the tinker client is not installed (pip install tinker==0.38.0)"
)
from tinker import types  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install -c lock-cpu.txt 'roll[cpu]')",
    ),
]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-vllm") / "ckpt"


@pytest.fixture(scope="module")
def server(ckpt_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(ckpt_dir, tmp_path_factory.mktemp("cache"), *VLLM)
    yield srv
    assert srv.stop() == 130


@pytest.fixture(scope="module")
def service(server: Server):
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    yield client
    client.close("success").result()


def _sample(sampler, prompt: list[int], n: int, seed: int):
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    return sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=n,
        sampling_params=params,
        include_prompt_logprobs=True,
    ).result()


def _check_against_forward(res, tc, prompt: list[int]) -> None:
    """Every sampled token's log-prob and the prompt's are the trained model's (a forward)."""
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        forward = _logprobs(tc, prompt + list(seq.tokens))
        np.testing.assert_allclose(seq.logprobs, forward[len(prompt) - 1 :], atol=2e-4)
    forward = _logprobs(tc, prompt + [1])
    assert res.prompt_logprobs[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], forward[: len(prompt) - 1], atol=2e-4)


def test_adapter_sessions_sample_the_trained_model(service, ckpt_dir: Path) -> None:
    # train_unembed (the client's default) puts an adapter on the tied output layer too
    tc = service.create_lora_training_client(base_model="roll/tiny-qwen3", rank=8).result()
    data = [_datum(t) for t in SFT]
    for _ in range(4):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    prompt = [5, 17, 23]

    live = tc.save_weights_and_get_sampling_client().result()  # an adapter written for it
    written = list((ckpt_dir / ".sampler-adapters").iterdir())
    assert len(written) == 1
    first = _sample(live, prompt, 3, seed=3)
    assert len(first.sequences) == 3
    _check_against_forward(first, tc, prompt)

    path = tc.save_weights_for_sampler("after-sft").result().path
    saved = service.create_sampling_client(model_path=path).result()
    again = _sample(saved, prompt, 3, seed=3)
    # the same adapter and seeds: the same tokens from the session on the checkpoint's files
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in first.sequences]
    _check_against_forward(again, tc, prompt)

    # the base model's session samples the base weights (a fresh adapter: B = 0)
    base = service.create_sampling_client(base_model="roll/tiny-qwen3").result()
    fresh = service.create_lora_training_client(base_model="roll/tiny-qwen3", rank=4).result()
    plain = _sample(base, prompt, 2, seed=3)
    _check_against_forward(plain, fresh, prompt)
    assert not np.allclose(plain.prompt_logprobs[1:], first.prompt_logprobs[1:], atol=1e-3)


def test_stop_tokens_and_greedy_on_vllm(service) -> None:
    check_stop_tokens_and_greedy(service)


def test_a_closed_session_removes_its_adapter_files(server: Server, ckpt_dir: Path) -> None:
    folder = ckpt_dir / ".sampler-adapters"
    before = set(folder.iterdir()) if folder.exists() else set()
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    tc = client.create_lora_training_client(base_model="roll/tiny-qwen3", rank=4).result()
    tc.save_weights_and_get_sampling_client().result()
    assert len(set(folder.iterdir()) - before) == 1
    client.close("success").result()  # the session ends: its sampler and adapter go
    assert set(folder.iterdir()) == before
